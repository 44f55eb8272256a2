"""Loading into any layout, and rewriting a checkpoint for a planned one.

Loading (every load reshards):

- :mod:`.plan` — read planning: overlapping chunks per destination piece, the frames they
  touch, reads cut at the read unit, ranges coalesced per file across small gaps;
- :mod:`.reader` — fetching ranges in parallel threads within the memory budget (pooled
  buffers), verifying every frame's checksum, decoding compressed frames;
- :mod:`.direct` — whole raw frames read straight into contiguous destination memory;
- :mod:`.read_once` — pieces several ranks need, read by one and broadcast;
- :mod:`.load` — the load itself: check, plan, verify pass, agreement, copy pass;
- :mod:`.verify` — ``ckptd verify``. The tunables, and why, are in :mod:`ckptd.config`.

The offline reshard (``ckptd reshard``, ``ckptd layout``):

- :mod:`.layout_file` — the layout file format; :mod:`.targets` — which boxes each target
  rank holds under a layout; :mod:`.infer` — a starting layout from names and shapes;
- :mod:`.offline` — writing the checkpoint packed per target rank; :mod:`.training` — the
  batch settings re-planned for the new world; :mod:`.commands` — the CLI.

``docs/loading.md`` and ``docs/layouts.md`` describe both, with measurements.
"""
