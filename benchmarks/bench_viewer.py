"""Offline viewer at scale: torchmem's ``view`` vs PyTorch's ``torch.cuda._memory_viz.trace_plot``.

On a generated snapshot of N trace events (default 1,000,000) in PyTorch's format, in one run:

* HTML generation time (Python) and HTML size relative to the pickle, for both tools;
* in headless Chromium (Debian's, via Playwright): time from navigation to the first drawn
  timeline (time to interactive), hover latency, zoom redraw time and allocator-state replay time
  for torchmem's page; PyTorch's page is loaded with the network blocked (its code comes from a
  CDN, so offline it cannot draw at all) and the requests it tried are reported.

With ``--file`` the snapshot is a real file instead (e.g. the 1,722-segment one in
``tests/data``), and the Segments tab is timed too (time to open it, rows in the page, page
height). Numbers are the minimum of ``--repeats`` runs. Usage::

    python benchmarks/bench_viewer.py [--events 1000000] [--repeats 3] [--file snapshot.pickle]
"""

from __future__ import annotations

import argparse
import os
import pickle
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _viewer_gen import make_snapshot
from torchmem.io.snapshot_file import load_snapshot
from torchmem.render.viewer.html import write_viewer
from torchmem.units import format_bytes

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]


def best(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--file", default=None, help="a real snapshot file instead of a generated one")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench_viewer_"))
    try:
        return run(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(args: argparse.Namespace, tmp: Path) -> int:
    if args.file:
        src = Path(args.file)
        with open(src, "rb") as f:
            snap = pickle.load(f)  # a file from tests/data: plain containers (its README)
    else:
        print(f"generating a {args.events:,}-event snapshot ...", flush=True)
        snap = make_snapshot(args.events)
        src = tmp / "snap.pickle"
        src.write_bytes(pickle.dumps(snap, protocol=4))
    n_events = len(snap["device_traces"][0])
    pkl = src.stat().st_size
    print(f"snapshot: {n_events:,} events, {len(snap['segments'])} segments, pickle "
          f"{format_bytes(pkl)}  (machine: {os.cpu_count()} shared cores)")

    ours = tmp / "torchmem.html"
    t_ours, _ = best(lambda: write_viewer(load_snapshot(src), ours, title=src.name), args.repeats)
    theirs_path = tmp / "pytorch.html"
    t_theirs = float("nan")
    try:
        from torch.cuda import _memory_viz

        def pytorch_html() -> None:
            with open(src, "rb") as f:
                data = pickle.load(f)
            theirs_path.write_text(_memory_viz.trace_plot(data))

        t_theirs, _ = best(pytorch_html, args.repeats)
    except Exception as e:  # noqa: BLE001 - report and carry on with ours
        print(f"PyTorch's trace_plot failed: {type(e).__name__}: {e}")
    s_ours = ours.stat().st_size
    s_theirs = theirs_path.stat().st_size if theirs_path.exists() else 0
    print("\nHTML generation (file -> HTML, min of repeats)")
    print(f"  torchmem view (safe load + payload)   {t_ours:7.2f} s   size {format_bytes(s_ours):>11} "
          f"= {s_ours / pkl:.2f}x the pickle")
    if s_theirs:
        print(f"  torch.cuda._memory_viz.trace_plot     {t_theirs:7.2f} s   size {format_bytes(s_theirs):>11} "
              f"= {s_theirs / pkl:.2f}x the pickle")
        print(f"  ratio: torchmem's HTML is {s_theirs / s_ours:.1f}x smaller; generation time "
              f"ratio torchmem/pytorch = {t_ours / t_theirs:.2f}")

    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        print("playwright not installed: browser figures skipped")
        return 0
    if not Path(CHROMIUM).exists():
        print("chromium not found: browser figures skipped")
        return 0
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        loads, hovers, zooms, replays, segtabs = [], [], [], [], []
        seg_rows = height = 0
        for _ in range(args.repeats):
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            foreign: list[str] = []
            errors: list[str] = []
            page.on("request", lambda r: foreign.append(r.url) if not r.url.startswith(("file:", "data:")) else None)  # noqa: B023
            page.on("pageerror", lambda e: errors.append(str(e)))  # noqa: B023
            t = time.perf_counter()
            page.goto(ours.as_uri())
            page.wait_for_selector("html[data-tm-ready]", state="attached", timeout=120_000)
            loads.append(time.perf_counter() - t)
            st = page.evaluate("window.__torchmem.stats()")
            band = page.evaluate("window.__torchmem.findBand()")
            t = time.perf_counter()
            page.mouse.move(band["x"], band["y"])
            page.wait_for_selector("#tooltip", state="visible")
            hovers.append(time.perf_counter() - t)
            zooms.append(min(page.evaluate(f"window.__torchmem.setView({a}, {a + n_events // 5}).drawMs")
                             for a in (0, n_events // 3, n_events // 2)) / 1000)
            t = time.perf_counter()
            page.evaluate("window.__torchmem.showTab('state'); window.__torchmem.selectEvent(10)")
            replays.append(time.perf_counter() - t)
            t = time.perf_counter()
            seg_rows = page.evaluate("window.__torchmem.showTab('segments'); document.querySelectorAll('#seg-body tr').length")
            segtabs.append(time.perf_counter() - t)
            height = page.evaluate("document.documentElement.scrollHeight")
            assert not foreign and not errors, (foreign, errors)
            page.close()
        print("\ntorchmem page in headless Chromium (min of repeats)")
        print(f"  navigation -> timeline drawn (time to interactive): {min(loads):.2f} s "
              f"(target <= 3 s; {st['bands']:,} allocations drawn in {st['columns']} columns)")
        print(f"  hover -> tooltip: {min(hovers) * 1000:.0f} ms;  zoom redraw: {min(zooms) * 1000:.0f} ms;  "
              f"allocator state replayed back to event 10: {min(replays) * 1000:.0f} ms")
        print(f"  Segments tab ({len(snap['segments']):,} segments): opened in {min(segtabs) * 1000:.0f} ms, "
              f"{seg_rows} rows in the page, page {height:,} px tall")
        print("  network requests: 0; JavaScript errors: 0")
        if s_theirs:
            page = browser.new_page()
            tried: list[str] = []

            def block(route) -> None:
                if route.request.url.startswith(("file:", "data:")):
                    route.continue_()
                else:
                    tried.append(route.request.url)
                    route.abort()

            page.route("**/*", block)
            page.goto(theirs_path.as_uri())
            page.wait_for_timeout(3000)
            svg = page.evaluate("document.querySelectorAll('svg path, svg rect').length")
            print("\nPyTorch's page offline (network blocked): "
                  f"{len(tried)} request(s) to fetch its code (e.g. {tried[0] if tried else '-'}); "
                  f"{svg} shapes drawn after 3 s -> blank")
            page.close()
        browser.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
