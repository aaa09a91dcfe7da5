"""Rank the stages, mark the bottleneck, and say one concrete thing to do about each finding."""

from __future__ import annotations

from gpufeed.doctor.stages import Timings

MODEL = "model step (ResNet-18)"
STEAL = 0.02  # the host's CPU time a hypervisor gave to others (steal) from which the doctor says so


def findings(t: Timings, gpu: bool) -> list[str]:
    """One recommendation per problem the timings show (shares are of the data stages' time)."""
    per = t.per_1000()
    data = {k: v for k, v in per.items() if k not in ("total (wall)", MODEL)}
    total = sum(data.values()) or 1.0
    share = {k: v / total for k, v in data.items()}
    out = []
    if MODEL in per and sum(data.values()) > per[MODEL]:
        out.append(f"the data pipeline needs {sum(data.values()) / per[MODEL]:.1f}x the model step's time on one "
                   "core: the model will wait for data unless loading is that many times parallel or cheaper")
    if share.get("decode", 0) > 0.3:
        out.append(f"decode is {share['decode']:.0%} of the time: pack to a raw store (gpufeed pack SRC DEST "
                   "--mode raw), or to a jpeg store decoded on the GPU (--mode jpeg)")
    if share.get("transform", 0) > 0.2:
        out.append(f"transforms are {share['transform']:.0%} of the time: augment whole batches on the GPU "
                   "(gpufeed.augment in gpufeed.Loader)")
    if share.get("read bytes", 0) > 0.2:
        out.append(f"reading files is {share['read bytes']:.0%} of the time: one memory-mapped store reads "
                   "sequentially from the page cache instead of one file per image")
    if share.get("produce batch (your iterable)", 0) > 0.5:
        out.append(f"your iterable takes {share['produce batch (your iterable)']:.0%} of the time: the GPU waits "
                   "for data; pack the dataset (gpufeed pack) and load it with gpufeed.Loader")
    if share.get("augment", 0) > 0.5:
        out.append(f"augmentation on the CPU is {share['augment']:.0%} of the time: on a CUDA device the same "
                   "ops run as one GPU kernel per batch")
    if share.get("waiting for data", 0) > 0.3:
        out.append(f"the consumer waited for data {share['waiting for data']:.0%} of the time: "
                   f"{'use a host or gpu tier (cache=)' if t.facts.get('tier') == 'disk' else 'more prefetch'}")
    if t.facts.get("host_steal_share", 0.0) >= STEAL:
        out.append(f"the hypervisor gave {t.facts['host_steal_share']:.0%} of this host's CPU time to others while "
                   "this ran (steal): what was measured here, and a training loop fed from a jpeg store, slow "
                   "down with it; compare runs made while it was low")
    if gpu and t.facts.get("dtype") == "float32" and "host-to-device" in per:
        out.append("float32 over the bus: send uint8 (4x fewer bytes) and convert/normalize on the GPU "
                   "(gpufeed.nn.Normalize)")
    if gpu and t.facts.get("pinned") is False and "host-to-device" in per:
        out.append("copies are pageable: pin memory (pin_memory=True) so copies run at full PCIe speed and "
                   "overlap compute")
    return out


def table(t: Timings) -> str:
    """The ranked stage table, slowest first, with the bottleneck marked."""
    per = t.per_1000()
    staged = {k: v for k, v in per.items() if k not in ("total (wall)", MODEL)}
    total = sum(staged.values()) or 1.0
    rows = sorted(staged.items(), key=lambda kv: -kv[1])
    width = max([len(k) for k in per] + [len(MODEL) + 11])
    lines = [f"{'stage':<{width}}  s / 1000 img   share", "-" * (width + 24)]
    for k, (name, value) in enumerate(rows):
        mark = "  <- bottleneck" if k == 0 else ""
        lines.append(f"{name:<{width}}  {value:12.3f}  {value / total:6.0%}{mark}")
    if MODEL in per:
        lines.append(f"{MODEL + ', for scale':<{width}}  {per[MODEL]:12.3f}")
    if "total (wall)" in per:
        lines.append(f"{'total (wall)':<{width}}  {per['total (wall)']:12.3f}  "
                     f"({1000 / max(per['total (wall)'], 1e-9):,.0f} img/s)")
    return "\n".join(lines)
