"""The elastic run's history as a picture: world size, global batch (with its tolerance band)
and loss against the step, a dashed line at every restart (``ckptd history --plot``, the demo)."""

from __future__ import annotations

from ckptd.elastic.history import TrainingMeta
from ckptd.errors import CkptdError


def plot_history(meta: TrainingMeta, path: str, *, last_step: int | None = None,
                 title: str | None = None) -> None:
    """Write a PNG: world size, global batch (with the tolerance band) and loss against step,
    a dashed line at every restart. Needs matplotlib (``pip install 'ckptd[plot]'``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise CkptdError("plotting needs matplotlib: pip install 'ckptd[plot]'") from e

    entries = list(meta.history)
    end = max([last_step or 0, *(s for s, _ in meta.losses), *(e.step for e in entries)])
    xs = [e.step for e in entries] + [end]
    fig, (ax_w, ax_b, ax_l) = plt.subplots(3, 1, sharex=True, figsize=(8, 7.5),
                                           gridspec_kw={"height_ratios": [1, 1, 2]})
    try:
        if entries:
            ax_w.step(xs, [e.world_size for e in entries] + [entries[-1].world_size],
                      where="post", color="tab:blue")
            ax_b.step(xs, [e.global_batch_size for e in entries]
                      + [entries[-1].global_batch_size], where="post", color="tab:green")
        ref = meta.reference.global_batch_size
        tol = meta.policy.tolerance
        ax_b.axhspan(ref * (1 - tol), ref * (1 + tol), color="tab:green", alpha=0.12,
                     label=f"reference {ref} ±{tol:.0%}")
        ax_b.legend(loc="lower right", fontsize=8)
        if meta.losses:
            ax_l.plot([s for s, _ in meta.losses], [v for _, v in meta.losses],
                      color="tab:red", linewidth=1)
        ax_w.set_ylabel("world size")
        ax_w.yaxis.get_major_locator().set_params(integer=True)
        if entries:
            ax_w.set_ylim(0, max(e.world_size for e in entries) + 1)
        ax_b.set_ylabel("global batch")
        ax_l.set_ylabel("loss")
        ax_l.set_xlabel("optimizer step")
        for entry in entries[1:]:
            for ax in (ax_w, ax_b, ax_l):
                ax.axvline(entry.step, color="gray", linestyle="--", linewidth=0.8)
        for entry in entries:
            ax_w.annotate(f"{entry.reason}: {entry.micro_batch_size}×"
                          f"{entry.gradient_accumulation_steps}, ZeRO-{entry.zero_stage}",
                          (entry.step, entry.world_size), textcoords="offset points",
                          fontsize=8, **({"xytext": (-3, 3), "ha": "right"}
                                         if entry.step > 0.7 * end else {"xytext": (3, 3)}))
        ax_w.set_title(title or f"elastic run: {len(entries)} incarnation(s), step {end}")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
