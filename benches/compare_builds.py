#!/usr/bin/env python
"""Two-build comparison: one benchmark run against the base commit's ``_core`` and the working tree's.

Builds ``ferrokv._core`` twice, each beside its own Python package:

- **base**: ``git archive <base>`` into a temporary directory, ``cargo build --release -p
  ferrokv-py`` there (shared target dir under ``--cache-dir``), then that commit's ``python/`` with
  the library copied in as ``ferrokv/_core.abi3.so``. Cached by commit hash under ``--cache-dir``:
  a second run against the same base does not rebuild.
- **new**: the working tree as it is on disk (committed or not): ``cargo build --release -p
  ferrokv-py`` in the repository, then a snapshot of its ``python/`` plus the library in a
  temporary directory (so that editing the tree during the run changes nothing).

Then it runs the benchmark in subprocesses with ``PYTHONPATH=<build>/python``, in ``--rounds``
rounds that alternate base, new, base, new, ... (drift in the machine's speed hits both builds
alike), and reports per size the median of each build and the median over rounds of the
ratio new/base (each ratio pairs the two runs of one round, which ran back to back).

Invariants:
- Both builds run the same benchmark script, the working tree's: only ``PYTHONPATH`` differs (so a
  benchmark flag added today works against an older base). Before timing, each build is checked
  to import ``ferrokv._core`` from its own directory.
- The benchmark contract: it prints JSON objects, one per line, each with ``"size"`` and the
  metric at the dotted path ``--metric``; lines without them are ignored; every requested size
  must be reported. It is called as ``<script> <args> --sizes a,b,c [--quick]``.
- Temporary directories are removed on exit, Ctrl-C and SIGTERM included; the cache is kept.

Costs: the first build of a base is a release build of the bindings (~1-3 min on 2 cores; the
registry dependencies are reused from the cache's target dir afterwards); the default benchmark
(``scheduler_bench.py --only-fixed``, 500 decode steps at 64..4096 running sequences) takes a few
seconds per run, so 5 rounds take about a minute.

Usage::

    python benches/compare_builds.py                     # committed HEAD vs the working tree
    python benches/compare_builds.py --base e259108      # that commit vs the working tree
    python benches/compare_builds.py --quick             # smoke: 64,256, --quick bench, 2 rounds
    python benches/compare_builds.py --json --out /tmp/cmp.json
    python benches/compare_builds.py --bench "benches/my_bench.py --json" --metric step.p50_us
    python benches/compare_builds.py --bench "benches/engine_step.py --json" --metric long.per_seq_step_us \
        --also short.per_seq_step_us                     # two metrics from the same runs
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_BENCH = "benches/scheduler_bench.py --only-fixed --json"
DEFAULT_METRIC = "decode.p50_us"
DEFAULT_SIZES = "64,256,1024,4096"
QUICK_SIZES = "64,256"
DEFAULT_CACHE = Path(tempfile.gettempdir()) / "ferrokv-compare-builds"
BUILDS = ("base", "new")


# ================================================================================================
# Pure logic: alternation, parsing, statistics, table (no I/O; tested in tests/test_compare_builds.py)
# ================================================================================================
def alternation(rounds: int) -> list[tuple[int, str]]:
    """(round, build) in run order: base, new, base, new, ..."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    return [(r, b) for r in range(rounds) for b in BUILDS]


def dig(obj: object, dotted: str) -> object:
    """``obj["a"]["b"]`` for ``"a.b"``; None when a key is missing."""
    for key in dotted.split("."):
        if not isinstance(obj, dict) or key not in obj:
            return None
        obj = obj[key]
    return obj


def parse_results(stdout: str, metric: str, sizes: list[int]) -> dict[int, float]:
    """{size: metric} from a benchmark's JSON lines; every size in ``sizes`` must be there once."""
    found: dict[int, float] = {}
    for line in stdout.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        obj = json.loads(line)
        size, value = dig(obj, "size"), dig(obj, metric)
        if not isinstance(size, int) or not isinstance(value, (int, float)) or size not in sizes:
            continue
        if size in found:
            raise ValueError(f"size {size} reported twice (metric {metric})")
        found[size] = float(value)
    missing = [s for s in sizes if s not in found]
    if missing:
        raise ValueError(f"the benchmark reported no {metric} for sizes {missing}")
    return found


def summarize(runs: dict[str, list[dict[int, float]]], sizes: list[int], tolerance: float) -> list[dict]:
    """One row per size from ``runs[build][round][size]``. ``ratio_median`` is the median of the
    per-round ratios new/base (a round's two runs ran back to back, so they share the machine's
    state); ``ratio_of_medians`` is given beside it."""
    if len(runs["base"]) != len(runs["new"]) or not runs["base"]:
        raise ValueError("both builds need the same number of rounds, at least one")
    rows = []
    for size in sizes:
        base = [r[size] for r in runs["base"]]
        new = [r[size] for r in runs["new"]]
        ratios = [n / b for b, n in zip(base, new)]
        ratio = statistics.median(ratios)
        rows.append({
            "size": size,
            "base": base,
            "new": new,
            "base_median": statistics.median(base),
            "new_median": statistics.median(new),
            "ratios": ratios,
            "ratio_median": ratio,
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "ratio_of_medians": statistics.median(new) / statistics.median(base),
            "within_tolerance": ratio <= 1.0 + tolerance,
        })
    return rows


def format_table(rows: list[dict], metric: str, tolerance: float) -> str:
    hdr = (f"{'size':>6} | {'base median':>11} {'new median':>11} | {'new/base median':>15} "
           f"{'(min-max over rounds)':>21} {'of medians':>10} | within {tolerance:.0%}")
    lines = [hdr, "-" * len(hdr)]
    for r in rows:
        spread = f"({r['ratio_min']:.3f}-{r['ratio_max']:.3f})"
        lines.append(
            f"{r['size']:>6} | {r['base_median']:>11.2f} {r['new_median']:>11.2f} | {r['ratio_median']:>15.3f} "
            f"{spread:>21} {r['ratio_of_medians']:>10.3f} | {'yes' if r['within_tolerance'] else 'NO (slower)'}"
        )
    lines.append(f"{metric} per run, median over rounds; ratio < 1: the new build is faster")
    return "\n".join(lines)


# ================================================================================================
# Builds: a self-contained python/ directory per build (package + its _core)
# ================================================================================================
@dataclass
class Build:
    name: str  # "base" or "new"
    label: str  # commit hash, "+dirty" when the working tree differs from it
    python_dir: Path  # goes on PYTHONPATH


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True).stdout.strip()


def cargo_build_core(src: Path, target_dir: Path | None) -> Path:
    """Release-builds ferrokv-py in ``src``; returns the path of its cdylib (cargo reports it,
    wherever the target dir is)."""
    env = dict(os.environ)
    if target_dir is not None:
        env["CARGO_TARGET_DIR"] = str(target_dir)
    print(f"[compare] cargo build --release -p ferrokv-py in {src}", file=sys.stderr, flush=True)
    proc = subprocess.run(["cargo", "build", "--release", "-p", "ferrokv-py", "--message-format=json-render-diagnostics"],
                          cwd=src, env=env, stdout=subprocess.PIPE, text=True, check=True)
    for line in proc.stdout.splitlines():
        msg = json.loads(line)
        if msg.get("reason") == "compiler-artifact" and "cdylib" in msg["target"]["kind"]:
            return Path(next(f for f in msg["filenames"] if f.endswith((".so", ".dylib", ".pyd"))))
    raise RuntimeError(f"cargo built no cdylib in {src}")


def install_package(python_src: Path, library: Path, dest: Path) -> None:
    """``dest`` = a copy of ``python_src`` without compiled leftovers, plus ``library`` as
    ``ferrokv/_core.abi3.so`` (the only ``_core`` there, so the import cannot pick another)."""
    shutil.copytree(python_src, dest, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyd"))
    shutil.copy2(library, dest / "ferrokv" / "_core.abi3.so")


def base_build(rev: str, cache_dir: Path, tmp: Path) -> Build:
    """The build of commit ``rev``, from the cache or built now and cached under its hash."""
    sha = git("rev-parse", "--verify", f"{rev}^{{commit}}")
    final = cache_dir / "builds" / sha / "python"
    if (final / "ferrokv" / "_core.abi3.so").is_file():
        print(f"[compare] base {sha[:12]}: cached in {final}", file=sys.stderr, flush=True)
        return Build("base", sha[:12], final)
    src = tmp / "base-src"
    src.mkdir()
    archive = subprocess.Popen(["git", "-C", str(ROOT), "archive", "--format=tar", sha], stdout=subprocess.PIPE)
    # -m: the files get the time of extraction. With the commit's time (git archive's), cargo
    # would find an earlier base's newer artifacts in the shared target dir fresh and reuse them:
    # it fingerprints workspace members by paths relative to the workspace root, and by mtimes.
    subprocess.run(["tar", "-x", "-m", "-C", str(src)], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise RuntimeError(f"git archive {sha} failed")
    # Installed beside the final place, then renamed: an interrupted build is never taken as cached.
    partial = cache_dir / "builds" / f"{sha}.partial-{os.getpid()}"
    try:
        # Other runs wait: the library cargo names is overwritten by the next build in this target dir.
        with open(cache_dir / "build.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            library = cargo_build_core(src, cache_dir / "target")
            install_package(src / "python", library, partial / "python")
        if not (final / "ferrokv" / "_core.abi3.so").is_file():  # an incomplete entry: replace it
            shutil.rmtree(final.parent, ignore_errors=True)
        try:
            partial.rename(final.parent)
        except OSError:  # another run cached it meanwhile: same commit, same result
            pass
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return Build("base", sha[:12], final)


def tree_build(tmp: Path) -> Build:
    """The working tree as it is on disk, snapshotted into ``tmp``."""
    library = cargo_build_core(ROOT, None)
    head = git("rev-parse", "HEAD")[:12]
    dirty = bool(git("status", "--porcelain"))
    install_package(ROOT / "python", library, tmp / "new" / "python")
    return Build("new", head + ("+dirty" if dirty else ""), tmp / "new" / "python")


# ================================================================================================
# Running
# ================================================================================================
def bench_env(build: Build) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(build.python_dir)  # replaces any other tree's path
    return env


def check_import(build: Build) -> None:
    """Fails unless ``ferrokv._core`` imports from this build's own directory."""
    code = "import ferrokv._core as c; print(c.__file__)"
    out = subprocess.run([sys.executable, "-c", code], env=bench_env(build), cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.strip()
    if Path(out).resolve().parent.parent != build.python_dir.resolve():
        raise RuntimeError(f"{build.name}: ferrokv._core imported from {out}, not from {build.python_dir}")


def run_bench(build: Build, cmd: list[str], metrics: list[str], sizes: list[int]) -> dict[str, dict[int, float]]:
    """One run of the benchmark: {metric: {size: value}} for each of ``metrics``."""
    proc = subprocess.run(cmd, env=bench_env(build), cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{build.name}: {shlex.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return {m: parse_results(proc.stdout, m, sizes) for m in metrics}


def run_rounds(builds: dict[str, Build], cmd: list[str], metrics: list[str], sizes: list[int],
               rounds: int) -> dict[str, dict[str, list[dict[int, float]]]]:
    """``runs[metric][build][round][size]``: every metric comes from the same runs."""
    runs: dict[str, dict[str, list[dict[int, float]]]] = {m: {b: [] for b in BUILDS} for m in metrics}
    for r, name in alternation(rounds):
        result = run_bench(builds[name], cmd, metrics, sizes)
        for m in metrics:
            runs[m][name].append(result[m])
        shown = " ".join(f"{s}:{v:.2f}" for s, v in result[metrics[0]].items())
        print(f"[compare] round {r + 1}/{rounds} {name:<4} {shown}", file=sys.stderr, flush=True)
    return runs


# ================================================================================================
# CLI
# ================================================================================================
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD", help="base commit (default HEAD: committed HEAD vs the working tree)")
    ap.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 5; 2 with --quick)")
    ap.add_argument("--sizes", default=None, help=f"comma-separated sizes (default {DEFAULT_SIZES}; {QUICK_SIZES} with --quick)")
    ap.add_argument("--bench", default=DEFAULT_BENCH,
                    help="benchmark script (relative to the repository root) and its arguments, one string")
    ap.add_argument("--metric", default=DEFAULT_METRIC, help="dotted path of the timing in each JSON line")
    ap.add_argument("--also", default="", help="more comma-separated metric paths read from the same runs")
    ap.add_argument("--tolerance", type=float, default=0.05, help="new/base above 1 + this is flagged (default 0.05)")
    ap.add_argument("--quick", action="store_true", help="smoke run: small sizes, the benchmark's --quick, 2 rounds")
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help=f"base builds by commit (default {DEFAULT_CACHE})")
    ap.add_argument("--json", action="store_true", help="print the report as one JSON object instead of the table")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON report there")
    args = ap.parse_args(argv)
    args.rounds = args.rounds or (2 if args.quick else 5)
    args.sizes = [int(x) for x in (args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)).split(",") if x]
    args.metrics = [args.metric] + [m for m in args.also.split(",") if m and m != args.metric]
    return args


def bench_command(args: argparse.Namespace) -> list[str]:
    script, *rest = shlex.split(args.bench)
    cmd = [sys.executable, str(ROOT / script), *rest, "--sizes", ",".join(map(str, args.sizes))]
    return cmd + (["--quick"] if args.quick else [])


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds through the cleanup below


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    (args.cache_dir / "builds").mkdir(exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="ferrokv-compare-"))
    try:
        builds = {"base": base_build(args.base, args.cache_dir, tmp), "new": tree_build(tmp)}
        for build in builds.values():
            check_import(build)
        cmd = bench_command(args)
        print(f"[compare] {args.rounds} rounds of: {shlex.join(cmd)}", file=sys.stderr, flush=True)
        runs = run_rounds(builds, cmd, args.metrics, args.sizes, args.rounds)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = summarize(runs[args.metric], args.sizes, args.tolerance)
    also = {m: summarize(runs[m], args.sizes, args.tolerance) for m in args.metrics[1:]}
    report = {
        "base": {"rev": args.base, "build": builds["base"].label},
        "new": {"tree": str(ROOT), "build": builds["new"].label},
        "bench": args.bench, "quick": args.quick, "metric": args.metric, "rounds": args.rounds,
        "tolerance": args.tolerance, "rows": rows, "also": also,
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    if args.json:
        print(json.dumps(report))
    else:
        print(f"base {builds['base'].label} ({args.base}) vs new {builds['new'].label} (working tree), "
              f"{args.rounds} alternating rounds")
        print(format_table(rows, args.metric, args.tolerance))
        for m, more in also.items():
            print(format_table(more, m, args.tolerance))
    return report


if __name__ == "__main__":
    main()
