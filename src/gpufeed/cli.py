"""The `gpufeed` command: pack, inspect, verify, bench, doctor, demo."""

from __future__ import annotations

import argparse
import io
import logging
import sys

from gpufeed._version import __version__

# Verbs import what they need when they run (torch takes seconds to import), so that
# `gpufeed --help` and `gpufeed --version` answer at once.


# gpufeed.packing.imaging.DEFAULT_MAX_PIXELS, written out: importing it would import numpy for --help
_MAX_PIXELS = 2 * 89_478_485
_SIZE = 256


def _pack(a: argparse.Namespace) -> int:
    """Pack; --size with --mode jpeg is a usage error (exit 2), not ignored: a jpeg store keeps each
    image's shape. SIGTERM cleans up as Ctrl-C does and exits 143. A pack that fails says what it had
    skipped, and why, as one that succeeds does."""
    if a.mode in ("jpeg", "video") and a.size is not None:
        a.usage_error(
            f"--size sets the side of --mode raw's square images; a {a.mode} store keeps each image's "
            "shape: bound its longer side with --max-side (jpeg) or set --short-side (video)"
        )
    if a.mode != "video" and (a.short_side, a.gop, a.fps) != (None, None, None):
        a.usage_error("--short-side, --gop and --fps re-encode videos: they need --mode video")
    from gpufeed.packing import PackError, pack
    from gpufeed.packing.sigterm import Terminated
    from gpufeed.packing.skips import summarize_skipped

    try:
        report = pack(
            a.source,
            a.dest,
            mode=a.mode,
            size=_SIZE if a.size is None else a.size,
            fit=a.fit,
            quality=a.quality,
            max_side=a.max_side,
            reencode=not a.no_reencode,
            workers=a.workers,
            on_error=a.on_error,
            overwrite=a.overwrite,
            exist_ok=a.exist_ok,
            max_pixels=a.max_pixels,
            engine=a.engine,
            ray_address=a.ray_address,
            images=a.images,
            short_side=a.short_side,
            gop=a.gop,
            fps=a.fps,
        )
    except Terminated as e:
        print("gpufeed pack: terminated (SIGTERM); nothing was left half-written", file=sys.stderr)
        return e.code  # type: ignore[return-value]  # 143
    except PackError as e:  # with what was skipped, and why: the reasons nothing could be packed
        print(f"gpufeed pack: error: {e}", file=sys.stderr)
        for line in summarize_skipped(e.skipped):
            print(line, file=sys.stderr)
        return 1
    print(report.summary())
    return 0


def _inspect(a: argparse.Namespace) -> int:
    from gpufeed.store import open_store
    from gpufeed.store.summary import describe, list_skipped, save_grid

    store = open_store(a.store)
    print(describe(store))
    listing = list_skipped(store, limit=None if a.all_skipped else 20)
    if listing:
        print(listing)
    if a.grid:
        path, undecodable = save_grid(store, a.grid)
        print(f"grid of samples written to {path}")
        if undecodable:
            shown = "; ".join(f"{i} ({why})" for i, why in list(undecodable.items())[:3])
            print(
                f"{len(undecodable)} sample{'s' if len(undecodable) > 1 else ''} could not be decoded, drawn blank: "
                f"{shown}{'; ...' if len(undecodable) > 3 else ''} ('gpufeed verify' checks the store's files)"
            )
    return 0


def _verify(a: argparse.Namespace) -> int:
    from gpufeed.store import verify

    result = verify(a.store)
    for name in result.checked:
        print(f"{name}: {result.damaged.get(name, 'ok')}")
    if result.ok:
        print(f"{result.path}: intact")
        return 0
    print(f"{result.path}: DAMAGED: {', '.join(sorted(result.damaged))}", file=sys.stderr)
    return 1


def _demo(a: argparse.Namespace) -> int:
    from gpufeed.demo import run_demo

    run_demo(a.dir, per_class=a.per_class)
    return 0


def _bench(a: argparse.Namespace) -> int:
    from gpufeed.bench import plot, run_bench

    if a.plot_only:
        print(f"{len(plot(a.out))} plot(s) and summary.md written to {a.out}")
        return 0
    run_bench(a.experiments or None, a.out, quick=a.quick, device=a.device)
    return 0


def _doctor(a: argparse.Namespace) -> int:
    from gpufeed.doctor import diagnose

    r = diagnose(a.target, device=a.device, limit=a.limit, trace=a.trace)
    if a.target is not None:
        print(f"{r['kind']} on {r['device']}: {r['images']} {r.get('unit', 'images')} timed\n")
        print(r["table"])
        print("\nfindings:" if r["findings"] else "\nfindings: none; the pipeline keeps up")
        for f in r["findings"]:
            print(f"  - {f}")
        print()
    for line in r["gpufeed"]:
        print(line)
    if a.trace:
        print(f"\ntrace written to {a.trace} (open in chrome://tracing or Perfetto)")
    return 0


def _positive(text: str) -> int:
    """argparse type: a whole number above 0 (anything else is a usage error, exit 2)."""
    try:
        number = int(text)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive whole number, not {text!r}")
    return number


def _quality(text: str) -> int:
    """argparse type: a JPEG quality, 1 to 100 (anything else is a usage error, exit 2, as `pack` checks it)."""
    try:
        number = int(text)
    except ValueError:
        number = 0
    if not 1 <= number <= 100:
        raise argparse.ArgumentTypeError(f"must be a whole number from 1 to 100, not {text!r}")
    return number


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False) or action.required:
            return action.help or ""
        return super()._get_help_string(action)  # type: ignore[return-value]  # a str: argparse makes None ""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpufeed",
        description="Image datasets onto the GPU at bus speed.",
        epilog="'gpufeed VERB --help' explains a verb and its options.",
    )
    p.add_argument("--version", action="version", version=f"gpufeed {__version__}")
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")

    def verb(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".", formatter_class=_Help)

    q = verb("pack", "pack an image folder, CSV/JSONL list, COCO annotations or tar shards into a store")
    q.add_argument(
        "source",
        help="image folder (one subfolder per class), .csv/.jsonl list (path,label), COCO annotation "
        ".json (with --images), .tar/.tar.gz shard or a quoted glob of shards",
    )
    q.add_argument("dest", help="store directory to create (written atomically)")
    q.add_argument(
        "--mode",
        choices=["raw", "jpeg", "video"],
        default="raw",
        help="raw: fixed-size uint8 pixels (fastest to load); jpeg: encoded bytes (about 4x smaller); "
        "video: video files (a folder of them, a .csv/.jsonl list with optional start,end seconds, or tar "
        "shards), kept as they are with their frame index",
    )
    q.add_argument(
        "--size",
        type=_positive,
        default=None,
        help=f"raw: side of the square images (default: {_SIZE}; jpeg: use --max-side)",
    )
    q.add_argument(
        "--fit",
        choices=["crop", "stretch", "pad"],
        default="crop",
        help="raw: how an image becomes square: centre crop of the shorter side, stretch, "
        "or pad the longer side with black",
    )
    q.add_argument("--quality", type=_quality, default=90, help="jpeg: re-encode quality (1 to 100)")
    q.add_argument("--max-side", type=_positive, default=512, help="jpeg: longest side kept")
    q.add_argument("--no-reencode", action="store_true", help="jpeg: keep baseline RGB JPEGs as they are")
    q.add_argument("--short-side", type=_positive, default=None, help="video: re-encode (H.264) to this short side")
    q.add_argument("--gop", type=_positive, default=None, help="video: re-encode with a keyframe every GOP frames")
    q.add_argument("--fps", type=float, default=None, help="video: re-encode at this frame rate")
    q.add_argument(
        "--max-pixels",
        type=_positive,
        default=_MAX_PIXELS,
        help="skip an image whose header declares more pixels than this, before decoding it",
    )
    q.add_argument("--workers", type=_positive, default=None, help="local processes (default: all cores)")
    q.add_argument(
        "--engine",
        choices=["local", "ray"],
        default="local",
        help="ray: pack on a Ray cluster's CPUs (needs gpufeed[ray] on every node)",
    )
    q.add_argument(
        "--ray-address", default=None, help="Ray cluster to join (default: RAY_ADDRESS, else a local cluster)"
    )
    q.add_argument(
        "--on-error",
        choices=["skip", "raise"],
        default="skip",
        help="skip: list a bad image in the report and go on; raise: stop at the first one",
    )
    q.add_argument("--overwrite", action="store_true", help="replace an existing destination")
    q.add_argument(
        "--exist-ok",
        action="store_true",
        help="keep a store at the destination packed from this source with these settings (pack nothing)",
    )
    q.add_argument("--images", default=None, help="a COCO annotation file's folder of images")
    q.set_defaults(run=_pack, usage_error=q.error)

    q = verb("inspect", "summarise a store and list its skipped files; --grid writes a PNG of samples")
    q.add_argument("store", help="store directory")
    q.add_argument("--grid", metavar="OUT.png", help="write a grid of 16 samples with their labels")
    q.add_argument("--all-skipped", action="store_true", help="list every skipped file (default: the first 20)")
    q.set_defaults(run=_inspect)

    q = verb("verify", "recompute a store's checksums; exit 1 naming each damaged file")
    q.add_argument("store", help="store directory")
    q.set_defaults(run=_verify)

    q = verb("bench", "measure transfers, dtype order, decoders, loaders and training on this machine")
    q.add_argument(
        "experiments",
        nargs="*",
        metavar="EXPERIMENT",
        help="transfer, dtype, decoders, loaders, training (default: all)",
    )
    q.add_argument("--quick", action="store_true", help="small sizes and few repeats")
    q.add_argument("--out", default="gpufeed-bench", help="folder for results.json, PNGs and summary.md")
    q.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda if available")
    q.add_argument("--plot-only", action="store_true", help="redraw plots and summary from results.json")
    q.set_defaults(run=_bench)

    q = verb("doctor", "time each stage of a data pipeline, name the bottleneck, report versions")
    q.add_argument(
        "target",
        nargs="?",
        help="image folder, gpufeed store, or module:function returning "
        "(images, labels) batches (none: only versions and decoders)",
    )
    q.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda if available")
    q.add_argument("--limit", type=_positive, default=256, help="images to time")
    q.add_argument("--trace", metavar="TRACE.json", help="write a torch.profiler Chrome trace")
    q.set_defaults(run=_doctor)

    q = verb("demo", "make sample images, pack them, load them, print measurements")
    q.add_argument("--dir", default="gpufeed-demo", help="working folder")
    q.add_argument("--per-class", type=_positive, default=64, help="sample images per class (4 classes)")
    q.set_defaults(run=_demo)
    return p


def _errors() -> tuple[type[BaseException], ...]:
    """The errors a verb reports as one line: bad input, named by path, never a traceback."""
    from gpufeed.loader.jpeg_batch import DecodeError
    from gpufeed.packing.packer import PackError
    from gpufeed.sources import SourceError
    from gpufeed.store.format import StoreError

    return PackError, SourceError, StoreError, DecodeError, ValueError, ImportError, OSError


class _LogFormat(logging.Formatter):
    """Puts "gpufeed: " before gpufeed's log messages, unless they name gpufeed themselves (the Loader's
    begin "gpufeed.Loader:"); another library's (a warning: their information is not shown) is named by
    its logger, never passed off as gpufeed's."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if record.name != "gpufeed" and not record.name.startswith("gpufeed."):
            return f"{record.name}: {text}"
        return text if text.startswith("gpufeed") else f"gpufeed: {text}"


def _print_any_name() -> None:
    """File names need not be UTF-8 (on Linux they are bytes; Python keeps the others as surrogates): a
    stream that can't encode a character prints it as a backslash escape, instead of failing half-way
    through a listing (PYTHONIOENCODING=utf-8, a C locale)."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="backslashreplace")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `gpufeed` console script; returns the exit code."""
    _print_any_name()
    handler = logging.StreamHandler()
    handler.setFormatter(_LogFormat())
    # gpufeed's information, other libraries' warnings: botocore's "Found credentials in environment
    # variables." and the like (INFO) were printed as "gpufeed: ..."
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    logging.getLogger("gpufeed").setLevel(logging.INFO)
    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print(f"gpufeed {args.verb}: interrupted; nothing was left half-written", file=sys.stderr)
        return 130
    except _errors() as e:
        # OSError's message names the file (an output folder missing, a disk full, ...)
        print(f"gpufeed {args.verb}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
