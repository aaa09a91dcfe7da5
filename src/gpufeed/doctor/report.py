"""Rank the stages, mark the bottleneck, and say one concrete thing to do about each finding."""

from __future__ import annotations

from gpufeed.doctor.stages import IDLE, LOOP, PARTS, WAIT, WALL, Timings

MODEL = "model step (ResNet-18)"
STEAL = 0.02  # the host's CPU time a hypervisor gave to others (steal) from which the doctor says so
WORTH = 0.2  # a stage's share from which the doctor says what to do about it
WAITED = 0.3  # the share of the wall time the loop waited for batches from which the doctor says what for
SUBJECT = {
    "transform": "transforms are",
    "read bytes": "reading files is",
    "augment": "augmentation on the CPU is",
    "produce batch (your iterable)": "your iterable takes",
}


def _stages(per: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in per.items() if k not in (WALL, MODEL)}


def bottleneck(per: dict[str, float]) -> str | None:
    """The slowest stage that works: waiting is what a slower stage causes, and a part counts in its whole."""
    work = {k: v for k, v in _stages(per).items() if k not in IDLE + PARTS}
    return max(work, key=work.__getitem__) if work else None


def shares(per: dict[str, float]) -> tuple[dict[str, float], str]:
    """Each stage's share, and of what: of the wall time where stages overlap (a store's, on the Loader's
    threads beside the loop: they need not add up to 100 %), else of their sum (one after another)."""
    staged = _stages(per)
    if WALL in per:
        return {k: v / max(per[WALL], 1e-9) for k, v in staged.items()}, "wall time"
    total = sum(staged.values()) or 1.0
    return {k: v / total for k, v in staged.items()}, "time"


def _advice(stage: str, t: Timings, gpu: bool, cuda: bool) -> str | None:
    """What to do when `stage` is slow, on this machine (`gpu`: the device measured is a CUDA GPU; `cuda`:
    this machine has one); None: nothing to do about it."""
    if stage == "decode":
        return "pack to a raw store (gpufeed pack SRC DEST --mode raw), whose images need no decoding" + (
            ", or to a jpeg store decoded on the GPU (--mode jpeg)" if gpu and t.kind == "image folder" else ""
        )
    if stage == "resize":
        return (
            "pack to a raw store at the training size (gpufeed pack SRC DEST --mode raw --size N), which needs "
            "neither decode nor resize, or to a jpeg store with a smaller --max-side (fewer pixels)"
        )
    if stage == "transform":
        return f"augment whole batches {'on the GPU' if gpu else 'at once'} (gpufeed.augment in gpufeed.Loader)"
    if stage == "read bytes":
        return "one memory-mapped store reads sequentially from the page cache instead of one file per image"
    if stage in ("read", "gather"):
        return "use a host or gpu tier (cache=)" if t.facts.get("tier") == "disk" else None  # memory's own speed
    if stage == "produce batch (your iterable)":
        return (
            f"the {'GPU' if gpu else 'model'} waits for data; pack the dataset (gpufeed pack) and load it "
            "with gpufeed.Loader"
        )
    if stage == "augment":  # on the CPU ("augment (launch)" on a GPU: the launches only)
        return (
            "on the CUDA device (--device cuda) the same ops run as one GPU kernel per batch"
            if cuda
            else "fewer or cheaper ops cost less on this CPU"
        )
    return None


def _stage_finding(stage: str, share: float, basis: str, t: Timings, gpu: bool, cuda: bool) -> list[str]:
    advice = _advice(stage, t, gpu, cuda)
    return [f"{SUBJECT.get(stage, stage + ' is')} {share:.0%} of the {basis}: {advice}"] if advice else []


def findings(t: Timings, gpu: bool, cuda: bool | None = None) -> list[str]:
    """One recommendation per problem the timings show, each following from the bottleneck the table
    names (`gpu`: measured on a CUDA device; `cuda`: this machine has one, default `gpu`)."""
    cuda = gpu if cuda is None else cuda
    per = t.per_1000()
    data = _stages(per)
    share, basis = shares(per)
    top = bottleneck(per)
    out = []
    if MODEL in per and sum(data.values()) > per[MODEL]:
        out.append(
            f"the data pipeline needs {sum(data.values()) / per[MODEL]:.1f}x the model step's time on one "
            "core: the model will wait for data unless loading is that many times parallel or cheaper"
        )
    if top is not None and share[top] >= WORTH:
        out += _stage_finding(top, share[top], basis, t, gpu, cuda)
    if WALL not in per:  # stages one after another: each slow one adds to the same time
        for stage in sorted(data, key=lambda k: -data[k]):
            if stage != top and share[stage] >= WORTH:
                out += _stage_finding(stage, share[stage], basis, t, gpu, cuda)
    elif share.get(WAIT, 0.0) >= WAITED and top is not None:
        if top in LOOP:  # the loader's stages are each faster than the loop, yet it waits: batches come unevenly
            out.append(
                f"the consumer waited for data {share[WAIT]:.0%} of the wall time though no stage of the "
                f"loader is slower than the loop's {top}: more prefetch (gpufeed.Loader(prefetch=N)) evens out "
                "the batches"
            )
        else:
            out.append(
                f"the consumer waited for data {share[WAIT]:.0%} of the wall time, for the loader's {top}, "
                "the slowest stage: making it cheaper is what helps"
            )
    if t.facts.get("host_steal_share", 0.0) >= STEAL:
        out.append(
            f"the hypervisor gave {t.facts['host_steal_share']:.0%} of this host's CPU time to others while "
            "this ran (steal): what was measured here, and a training loop fed from a jpeg store, slow "
            "down with it; compare runs made while it was low"
        )
    if gpu and t.facts.get("dtype") == "float32" and "host-to-device" in per:
        out.append(
            "float32 over the bus: send uint8 (4x fewer bytes) and convert/normalize on the GPU (gpufeed.nn.Normalize)"
        )
    if gpu and t.facts.get("pinned") is False and "host-to-device" in per:
        out.append(
            "copies are pageable: pin memory (pin_memory=True) so copies run at full PCIe speed and overlap compute"
        )
    return out


def table(t: Timings) -> str:
    """The ranked stage table: stages that work, slowest first with the bottleneck marked, then the waits."""
    per = t.per_1000()
    staged, (share, _), top = _stages(per), shares(per), bottleneck(per)
    rows = sorted(staged, key=lambda k: (k in IDLE, -staged[k]))
    width = max([len(k) for k in per] + [len(MODEL) + 11])
    per_unit = "s / 1000 img" if t.unit == "img" else f"s/1000 {t.unit}"[:12]  # (12 wide, as the figures)
    lines = [f"{'stage':<{width}}  {per_unit:>12}  {'% of wall' if WALL in per else 'share':>9}", "-" * (width + 25)]
    for name in rows:
        mark = "  <- bottleneck" if name == top else "  (waiting)" if name in IDLE else ""
        lines.append(f"{name:<{width}}  {staged[name]:12.3f}  {share[name]:9.0%}{mark}")
    if MODEL in per:
        lines.append(f"{MODEL + ', for scale':<{width}}  {per[MODEL]:12.3f}")
    if WALL in per:
        lines.append(f"{WALL:<{width}}  {per[WALL]:12.3f}  ({1000 / max(per[WALL], 1e-9):,.0f} {t.unit}/s)")
        lines.append(
            "% of wall: the loader's stages run on its threads beside your loop, so stages overlap and "
            "need not add up to 100 %"
        )
    return "\n".join(lines)
