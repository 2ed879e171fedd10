"""The offline viewer in a real headless Chromium (Debian's ``chromium``, driven by Playwright).

For real CUDA snapshots (modern and legacy), a CPU snapshot and a tracker trace: the page makes
no network request and raises no JavaScript error, the timeline draws (shape count from the
page's hook and pixels of a screenshot), hovering a band shows the stack recorded in the file,
and the allocator state replayed in the page matches a replay done here in Python.
"""

from __future__ import annotations

import io
import pickle
import sys
from pathlib import Path
from typing import Any

import pytest

from torchmem.io.snapshot_file import load_snapshot
from torchmem.render.viewer.html import write_viewer

pytestmark = pytest.mark.browser

DATA = Path(__file__).resolve().parent / "data"
ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]


class Page:
    """A loaded report page with every request and error recorded."""

    def __init__(self, browser: Any, html: Path) -> None:
        self.url = html.resolve().as_uri()
        self.requests: list[str] = []
        self.errors: list[str] = []
        self.page = browser.new_page(viewport={"width": 1300, "height": 850})
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        self.page.on(
            "console", lambda m: self.errors.append(f"console: {m.text}") if m.type == "error" else None
        )
        self.page.goto(self.url)
        self.page.wait_for_selector(
            "html[data-tm-ready], html[data-tm-error]", state="attached", timeout=30000
        )

    def js(self, expr: str) -> Any:
        return self.page.evaluate(expr)

    def settle(self) -> None:
        """Wait until the redraws scheduled by the last input (animation frames) have run."""
        self.page.evaluate("new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")

    def check_offline_and_clean(self) -> None:
        assert self.js("window.__torchmem.error") is None
        foreign = [u for u in self.requests if u != self.url and not u.startswith("data:")]
        assert foreign == []
        assert self.errors == []

    def close(self) -> None:
        self.page.close()


def _nonblank_fraction(png: bytes) -> tuple[float, int]:
    from PIL import Image

    raw = Image.open(io.BytesIO(png)).convert("RGB").tobytes()
    px = [raw[i : i + 3] for i in range(0, len(raw), 3)]
    colored = [p for p in px if p != b"\xff\xff\xff"]
    return len(colored) / len(px), len(set(colored))


def _frames_by_addr(raw: Any) -> dict[int, set[str]]:
    """Frame names recorded in the file for each allocation address (trace allocs and blocks)."""
    out: dict[int, set[str]] = {}
    traces = raw.get("device_traces", []) if isinstance(raw, dict) else []
    for t in traces:
        for e in t:
            if e.get("action") in ("alloc", "free_requested", "free_completed"):
                out.setdefault(e["addr"], set()).update(f["name"] for f in e.get("frames") or [])
    segs = raw["segments"] if isinstance(raw, dict) else raw
    for s in segs:
        off = s["address"]
        for b in s["blocks"]:
            addr = b.get("address", off)
            off += b["size"]
            names = {f["name"] for f in b.get("frames") or []}
            for h in b.get("history") or []:
                names |= {f["name"] for f in h.get("frames") or []}
            out.setdefault(addr, set()).update(names)
    return out


def _check_page(browser: Any, html: Path, raw: Any, *, expect_stack: bool = True) -> Page:
    p = Page(browser, html)
    try:
        p.check_offline_and_clean()
        st = p.js("window.__torchmem.stats()")
        assert st["bands"] > 0 and st["bands"] <= st["allocs"]
        frac, colors = _nonblank_fraction(p.page.locator("#timeline").screenshot())
        assert frac > 0.05 and colors >= 3
        band = p.js(f"window.__torchmem.findBand({'true' if expect_stack else 'false'})")
        assert band is not None
        p.page.mouse.move(band["x"], band["y"])
        tip = p.page.locator("#tooltip")
        tip.wait_for(state="visible", timeout=3000)
        text = tip.inner_text()
        addr = int(band["addr"])
        assert hex(addr) in text
        assert f"({int(band['size'])} bytes)" in text
        if expect_stack:
            names = _frames_by_addr(raw).get(addr, set())
            assert names, "the hovered allocation's address must be in the file"
            assert any(n in text for n in names), text[:500]
        p.check_offline_and_clean()
        return p
    except BaseException:
        p.close()
        raise


REAL = [
    "DeComFL__memory.pickle",
    "MAGMA27_a2__memory_snapshot.pickle",
    "notHanmin_a2__memory_snapshot_forward.pickle",
    "SketchKV2__my_snapshot.pickle",
    "LLM-inference__oom_snapshot_41810ba.pickle",  # legacy 2.0 history format
    "LLM-inference__1.3b_snapshot_6a8eab0.pickle",  # legacy 2.0 history format
]


@pytest.mark.parametrize("name", REAL)
def test_real_snapshot_renders_offline_with_stacks(browser: Any, tmp_path: Path, name: str) -> None:
    src = DATA / name
    raw = pickle.loads(src.read_bytes())  # plain containers only (tests/data/README.md)
    html = write_viewer(load_snapshot(src), tmp_path / "r.html")
    p = _check_page(browser, html, raw)
    try:
        # The stats tab shows the end state's allocated bytes, summed here from the blocks.
        p.js("window.__torchmem.showTab('stats')")
        want = sum(b["size"] for s in raw["segments"] for b in s["blocks"]
                   if b["state"] == "active_allocated")
        got = p.page.locator("#stats-table td[data-key=allocated_bytes]").get_attribute("data-value")
        assert int(got) == want
        p.js("window.__torchmem.showTab('segments')")
        seg = p.js("window.__torchmem.segments()")
        assert seg["total"] == seg["shown"] == len(raw["segments"])
        # every segment is reachable, only those near the view are in the page
        assert p.page.locator("#seg-body tr.seg").count() == seg["last"] - seg["first"] > 0
        p.check_offline_and_clean()
    finally:
        p.close()


def test_state_only_snapshot_without_stacks(browser: Any, tmp_path: Path) -> None:
    src = DATA / "Attention__memory.pickle"  # device_traces empty, blocks carry no Python frames
    raw = pickle.loads(src.read_bytes())
    p = _check_page(browser, write_viewer(load_snapshot(src), tmp_path / "a.html"), raw, expect_stack=False)
    try:
        active = [b for s in raw["segments"] for b in s["blocks"] if b["state"] != "inactive"]
        assert p.js("window.__torchmem.stats()")["allocs"] == len(active)
        p.js("window.__torchmem.showTab('state')")
        m = p.js("window.__torchmem.mapStats()")
        assert m["segments"] == len(raw["segments"]) and m["blocks"] == len(active)
        assert m["reserved"] == sum(s["total_size"] for s in raw["segments"])
    finally:
        p.close()


def _replay(trace: list[dict[str, Any]], k: int) -> tuple[int, int, int]:
    """Segments, live blocks and allocated bytes after the first k events (independent replay
    for a trace recorded from empty)."""
    segs: dict[int, int] = {}
    live: dict[int, tuple[int, bool]] = {}
    for e in trace[:k]:
        a = e["action"]
        if a == "segment_alloc":
            segs[e["addr"]] = e["size"]
        elif a == "segment_free":
            segs.pop(e["addr"])
        elif a == "alloc":
            live[e["addr"]] = (e["size"], False)
        elif a == "free_requested":
            live[e["addr"]] = (live[e["addr"]][0], True)
        elif a == "free_completed":
            live.pop(e["addr"])
    return len(segs), len(live), sum(s for s, pending in live.values() if not pending)


def test_allocator_state_history_matches_a_python_replay(browser: Any, tmp_path: Path) -> None:
    src = DATA / "DeComFL__memory.pickle"  # complete trace from an empty device (README)
    raw = pickle.loads(src.read_bytes())
    trace = raw["device_traces"][0]
    p = Page(browser, write_viewer(load_snapshot(src), tmp_path / "d.html"))
    try:
        p.js("window.__torchmem.showTab('state')")
        end = p.js("window.__torchmem.mapStats()")
        assert (end["segments"], end["blocks"]) == (61, 397)
        assert end["reserved"] == sum(s["total_size"] for s in raw["segments"])
        for k in (0, 1234, 11205, 17000, len(trace)):
            p.js(f"window.__torchmem.selectEvent({k})")
            m = p.js("window.__torchmem.mapStats()")
            segs, blocks, _ = _replay(trace, k)
            assert (m["segments"], m["blocks"]) == (segs, blocks), k
        # Hovering a block of the map shows its allocation's stack.
        p.js("window.__torchmem.selectEvent(11205)")
        box = p.page.locator("#statemap").bounding_box()
        shown = ""
        for dx in range(5, int(box["width"]), 37):
            p.page.mouse.move(box["x"] + dx, box["y"] + 6)
            if p.page.locator("#tooltip").is_visible():
                shown = p.page.locator("#tooltip").inner_text()
                if "allocated block" in shown:
                    break
        assert "allocated block 0x" in shown and "stack, innermost first" in shown
        p.check_offline_and_clean()
    finally:
        p.close()


def test_zoom_pan_and_range_filter(browser: Any, tmp_path: Path) -> None:
    src = DATA / "MAGMA27_a2__memory_snapshot.pickle"
    p = Page(browser, write_viewer(load_snapshot(src), tmp_path / "m.html"))
    try:
        page = p.page
        n = p.js("window.__torchmem.stats()")["events"]
        assert int(page.input_value("#range-to")) == n
        box = page.locator("#timeline").bounding_box()
        page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        for _ in range(4):
            page.mouse.wheel(0, -200)
            p.settle()
        lo, hi = int(page.input_value("#range-from")), int(page.input_value("#range-to"))
        assert 0 < lo < hi < n and hi - lo < n / 2  # zoomed in around the middle
        page.mouse.move(box["x"] + box["width"] / 2, box["y"] + 40)
        page.mouse.down()
        page.mouse.move(box["x"] + box["width"] / 2 + 200, box["y"] + 40, steps=4)
        page.mouse.up()
        p.settle()
        lo2, hi2 = int(page.input_value("#range-from")), int(page.input_value("#range-to"))
        assert lo2 < lo and abs((hi2 - lo2) - (hi - lo)) <= 2  # panned left, same width
        page.fill("#range-from", "1000")
        page.fill("#range-to", "2000")
        page.click("#range-apply")
        p.settle()
        assert (int(page.input_value("#range-from")), int(page.input_value("#range-to"))) == (1000, 2000)
        assert "events 1000–2000 of" in page.inner_text("#timeline-summary")
        assert p.js("window.__torchmem.stats()")["bands"] > 0
        page.dblclick("#timeline")
        p.settle()
        assert int(page.input_value("#range-to")) == n
        # Time-range filter: seconds since the first event; the events shown are counted here.
        raw = pickle.loads(src.read_bytes())
        times = [e["time_us"] for e in raw["device_traces"][0]]
        t0 = min(times)
        lo_s, hi_s = (times[n // 4] - t0) / 1e6, (times[n // 2] - t0) / 1e6
        page.select_option("#xmode", "time")
        # Let the redraw that the mode switch scheduled run first: it rewrites the fields, and a
        # redraw between fill()'s select-all and its typing would append to the old text.
        p.settle()
        page.fill("#range-from", f"{lo_s:.6f}")
        page.fill("#range-to", f"{hi_s:.6f}")
        page.click("#range-apply")
        p.settle()
        run, a, b = float("-inf"), 0, 0
        for t in times:
            run = max(run, t - t0)
            a += run <= round(lo_s * 1e6)
            b += run <= round(hi_s * 1e6)
        assert 0 < a < b < n
        assert f"events {a}–{b} of {n}" in page.inner_text("#timeline-summary")
        assert p.js("window.__torchmem.stats()")["bands"] > 0
        p.check_offline_and_clean()
    finally:
        p.close()


def test_a_redraw_never_overwrites_a_range_being_typed(browser: Any, tmp_path: Path) -> None:
    """A redraw (here a window resize) while the user types a range keeps what was typed; applying
    it then shows exactly that range, and zooming afterwards shows the view again."""
    p = Page(browser, write_viewer(load_snapshot(DATA / "MAGMA27_a2__memory_snapshot.pickle"),
                                   tmp_path / "r.html"))
    try:
        page = p.page
        n = p.js("window.__torchmem.stats()")["events"]
        draws = p.js("window.__torchmem._tl.draws")
        page.fill("#range-from", "1234")
        page.evaluate("window.dispatchEvent(new Event('resize'))")
        p.settle()
        assert p.js("window.__torchmem._tl.draws") > draws  # the timeline did redraw
        assert page.input_value("#range-from") == "1234"
        assert int(page.input_value("#range-to")) == n
        page.click("#range-apply")
        p.settle()
        assert f"events 1234–{n} of {n}" in page.inner_text("#timeline-summary")
        box = page.locator("#timeline").bounding_box()
        page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        page.mouse.wheel(0, -200)
        p.settle()
        assert int(page.input_value("#range-from")) > 1234  # the fields follow the view again
        p.check_offline_and_clean()
    finally:
        p.close()


def cpu_training(optimizer: str = "SGD") -> tuple[Any, Any, Any]:
    """A small MLP, its optimizer and one real CPU training step (model, optimizer, step)."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    opt = getattr(torch.optim, optimizer)(model.parameters(), lr=0.1)

    def step() -> None:
        model(torch.randn(32, 64)).sum().backward()
        opt.step()
        opt.zero_grad()

    return model, opt, step


def test_cpu_snapshot_and_tracker_trace(browser: Any, tmp_path: Path) -> None:
    import torchmem

    model, opt, step = cpu_training()
    with torchmem.record_history(device="cpu") as rec:
        step()
        step()
    cpu_snap = tmp_path / "cpu.pickle"
    torchmem.write_snapshot(cpu_snap, rec.snapshot())
    with torchmem.track(model, opt, stacks=True) as tr:
        step()
        step()
    trace_file = tmp_path / "run.tmtrace"
    tr.save(trace_file)
    this_file = Path(__file__).name
    for src in (cpu_snap, trace_file):
        html = write_viewer(load_snapshot(src), tmp_path / (src.stem + ".html"))
        p = Page(browser, html)
        try:
            p.check_offline_and_clean()
            assert p.js("window.__torchmem.stats()")["bands"] > 0
            frac, _ = _nonblank_fraction(p.page.locator("#timeline").screenshot())
            assert frac > 0.05
            band = p.js("window.__torchmem.findBand(true)")
            p.page.mouse.move(band["x"], band["y"])
            p.page.locator("#tooltip").wait_for(state="visible", timeout=3000)
            text = p.page.locator("#tooltip").inner_text()
            assert hex(int(band["addr"])) in text
            # The stacks recorded on CPU point into this very test.
            info = p.js(f"window.__torchmem.allocInfo({band['id']})")
            assert any(this_file in f[1] for f in info["stack"]) or this_file in text
            p.check_offline_and_clean()
        finally:
            p.close()


def test_100k_event_snapshot_stays_interactive(browser: Any, tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from _viewer_gen import make_snapshot
    finally:
        sys.path.pop(0)
    snap = make_snapshot(100_000, seed=1)
    src = tmp_path / "big.pickle"
    src.write_bytes(pickle.dumps(snap, protocol=4))
    html = write_viewer(load_snapshot(src), tmp_path / "big.html")
    assert html.stat().st_size < src.stat().st_size / 2
    p = Page(browser, html)
    try:
        p.check_offline_and_clean()
        st = p.js("window.__torchmem.stats()")
        n_alloc = sum(e["action"] == "alloc" for e in snap["device_traces"][0])
        assert st["events"] == len(snap["device_traces"][0]) and st["allocs"] == n_alloc
        assert st["bands"] > 100
        p.js("window.__torchmem.showTab('state')")
        p.js("window.__torchmem.selectEvent(5)")
        assert p.js("window.__torchmem.mapStats()")["blocks"] == _replay(snap["device_traces"][0], 5)[1]
        p.check_offline_and_clean()
    finally:
        p.close()


def test_synthetic_state_history_pending_expandable_oom(browser: Any, tmp_path: Path) -> None:
    from test_viewer import MiB, synthetic_snapshot

    snap = synthetic_snapshot()
    src = tmp_path / "syn.pickle"
    src.write_bytes(pickle.dumps(snap, protocol=2))
    p = Page(browser, write_viewer(load_snapshot(src), tmp_path / "syn.html"))
    try:
        p.js("window.__torchmem.showTab('state')")
        # (segments, blocks, reserved, allocated, active) after k events, worked out by hand.
        want = {
            0: (0, 0, 0, 0, 0),
            1: (1, 0, 2 * MiB, 0, 0),
            5: (2, 3, 4 * MiB, 1536 + 2 * MiB, 1536 + 2 * MiB),
            7: (2, 4, 4 * MiB, 1536 + 2 * MiB, 1536 + 2 * MiB + 4096),
            8: (2, 3, 4 * MiB, 1536 + 2 * MiB, 1536 + 2 * MiB),
            9: (2, 3, 4 * MiB, 512 + 2 * MiB, 1536 + 2 * MiB),
            10: (2, 3, 6 * MiB, 512 + 2 * MiB, 1536 + 2 * MiB),
            11: (2, 3, 6 * MiB, 512 + 2 * MiB, 1536 + 2 * MiB),
        }
        for k in (11, 0, 5, 1, 9, 7, 10, 8):  # both directions from a cached position
            p.js(f"window.__torchmem.selectEvent({k})")
            m = p.js("window.__torchmem.mapStats()")
            got = (m["segments"], m["blocks"], m["reserved"], m["allocated"], m["active"])
            assert got == want[k], k
        p.js("window.__torchmem.showTab('stats')")
        text = p.page.inner_text("#stats")
        assert "Out-of-memory events" in text and "8.00 MiB" in text and "fn1" in text
        assert "expandable_segments" in text
        p.check_offline_and_clean()
    finally:
        p.close()


def test_two_devices_switch(browser: Any, tmp_path: Path) -> None:
    from test_viewer import MiB, synthetic_snapshot

    snap = synthetic_snapshot()
    frames = [{"name": "on_gpu1", "filename": "/src/g1.py", "line": 7}]
    snap["segments"].append({
        "device": 1, "address": 0x9000000, "total_size": 20 * MiB, "stream": 0,
        "segment_type": "large", "frames": [], "blocks": [
            {"address": 0x9000000, "size": 20 * MiB, "requested_size": 20 * MiB,
             "state": "active_allocated", "frames": frames}]})
    snap["device_traces"].append([
        {"action": "alloc", "addr": 0x9000000, "size": 20 * MiB, "stream": 0, "frames": frames,
         "time_us": 5}])
    src = tmp_path / "two.pickle"
    src.write_bytes(pickle.dumps(snap, protocol=4))
    p = Page(browser, write_viewer(load_snapshot(src), tmp_path / "two.html"))
    try:
        # cuda:0 has the OOM: the page opens there and marks it. Its peak, by hand: requests of
        # 500 + 1024 + 2 MiB + 4096 B live at once = 2.0054 MiB.
        assert p.page.input_value("#device") == "0"
        assert p.page.locator("#device option").all_inner_texts() == [
            "cuda:0 (11 events, peak 2.01 MiB) \u26a0 OOM", "cuda:1 (1 events, peak 20.00 MiB)"]
        p.page.select_option("#device", "1")
        p.settle()
        st = p.js("window.__torchmem.stats()")
        assert (st["device"], st["events"], st["allocs"], st["bands"]) == (1, 1, 1, 1)
        band = p.js("window.__torchmem.findBand(true)")
        p.page.mouse.move(band["x"], band["y"])
        p.page.locator("#tooltip").wait_for(state="visible", timeout=3000)
        assert "on_gpu1" in p.page.locator("#tooltip").inner_text()
        p.js("window.__torchmem.showTab('stats')")
        got = p.page.locator("#stats-table td[data-key=allocated_bytes]").get_attribute("data-value")
        assert int(got) == 20 * MiB
        p.check_offline_and_clean()
    finally:
        p.close()


@pytest.mark.parametrize("name", ["MAGMA27_a2__memory_snapshot.pickle", "DeComFL__memory.pickle"])
def test_allocator_state_history_is_the_simulators_state(browser: Any, tmp_path: Path, name: str) -> None:
    """At events of a real snapshot (MAGMA27: mid-run, its start rebuilt; DeComFL: from empty),
    the page's state map shows exactly the simulator's segments and blocks, slack included."""
    from torchmem.sim.replay import TraceReplay

    snap = load_snapshot(DATA / name)
    n = len(snap.trace(0))
    p = Page(browser, write_viewer(snap, tmp_path / "s.html"))
    try:
        p.js("window.__torchmem.showTab('stats')")
        assert "simulated: every alloc replayed at its real address" in p.page.inner_text("#stats")
        p.js("window.__torchmem.showTab('state')")
        assert "block sizes: exact (allocator simulator)" in p.page.inner_text("#state-summary")
        for k in (0, n // 3, (2 * n) // 3 + 1, n):
            tr = TraceReplay(snap, 0)
            tr.run(k)
            want = [
                [addr, size, [[off, bs, 1 if on else 0] for off, bs, on in blocks]]
                for addr, size, _stream, blocks in tr.allocator.layout()
            ]
            got = p.js(f"window.__torchmem.stateLayout({k})")
            # pending frees (state 2) are still blocks of the simulator: compare them as allocated
            got = [[a, s, [[o, bs, 1 if st else 0] for o, bs, st in bl]] for a, s, bl in got]
            assert got == want, k
        # blocks the trace allocates carry slack that rounding to 512 B (the page's fallback)
        # would miss: the states above are exact only with the simulator's block sizes
        t = snap.trace(0)
        whole = TraceReplay(snap, 0)
        whole.run()
        slack = [i for i in range(n) if t[i].action == "alloc"
                 and whole.block_sizes[i] != max(512, -(-t.sizes[i] // 512) * 512)]
        assert slack
        p.check_offline_and_clean()
    finally:
        p.close()
