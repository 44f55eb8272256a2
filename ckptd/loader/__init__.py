"""The loader: a committed step loaded into any layout (every load reshards).

- :mod:`.reader` — which step (the newest committed, or the one asked for; a step rotated away
  while being read) and :class:`~ckptd.LoadResult`;
- :mod:`.plan` — read planning: overlapping chunks per destination piece, the frames they
  touch, reads cut at the read unit, ranges coalesced per file across small gaps;
- :mod:`.fetch` — fetching ranges in parallel threads within the memory budget (pooled
  buffers), verifying every frame's checksum, decoding compressed frames;
- :mod:`.direct` — whole raw frames read straight into contiguous destination memory;
- :mod:`.read_once` — pieces several ranks need, read by one and broadcast;
- :mod:`.load` — the load itself: check, plan, verify pass, agreement, copy pass;
- :mod:`.verify` — ``ckptd verify``. The tunables, and why, are in :mod:`ckptd.config`.

Layouts, which a load and the offline reshard (:mod:`ckptd.elastic.resharder`, composed by
:func:`ckptd.reshard`) share:

- :mod:`.layout_file` — the layout file format; :mod:`.targets` — which boxes each target
  rank holds under a layout; :mod:`.infer` — a starting layout from names and shapes.

``docs/loading.md`` and ``docs/layouts.md`` describe both, with measurements.
"""
