"""What a pack skipped, summed up for a person: how many for each reason, most first, with a few of
their paths. A pack that skips thousands of files for one reason (a COCO file's annotations, a list's
missing labels) says so in a line, not in thousands; the store's manifest (or `PackError.skipped`,
where nothing was packed) lists each one."""

from __future__ import annotations

REASONS = 10  # reasons shown, most frequent first
EXAMPLES = 3  # paths shown per reason


def summarize_skipped(skipped: list[dict[str, str]], where: str = "") -> list[str]:
    """Lines saying how many were skipped, then per reason (the REASONS most frequent, ties in the order
    first met) its count and up to EXAMPLES paths; `where` says where the full list is."""
    if not skipped:
        return []
    paths: dict[str, list[str]] = {}
    for s in skipped:
        paths.setdefault(s["reason"], []).append(s["path"])
    ranked = sorted(paths.items(), key=lambda item: -len(item[1]))  # stable: ties stay in order met
    width = len(str(len(ranked[0][1])))
    lines = [f"skipped {len(skipped)}{f' ({where})' if where else ''}:"]
    for reason, some in ranked[:REASONS]:
        shown = ", ".join(some[:EXAMPLES]) + (f", +{len(some) - EXAMPLES} more" if len(some) > EXAMPLES else "")
        lines.append(f"  {len(some):>{width}}  {reason}  [{shown}]")
    if len(ranked) > REASONS:
        rest = sum(len(some) for _, some in ranked[REASONS:])
        lines.append(f"  ... and {rest} more, for {len(ranked) - REASONS} other reasons")
    return lines
