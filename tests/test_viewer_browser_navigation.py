"""The viewer's navigation in a real headless Chromium (issue 13, "Viewer"), on real files.

Each test clicks, types and scrolls as a user would and checks what the page shows against
figures computed here in Python from the file itself: the timeline click opens the allocator
state at the clicked entry; a multi-GPU file opens on the device with the OOM (else the largest
peak); the Segments tab of the 1,722-segment snapshot sorts, filters and draws only what is
visible; a torchmem trace of a real CPU run is coloured by category with a legend, shows
category, phase and module on hover and the storages' own figures in the Stats tab; times count
from the start of the run and the axes start at 0.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from test_viewer_browser import DATA, Page, _replay, cpu_training
from torchmem.cli import main
from torchmem.io.snapshot_file import load_snapshot
from torchmem.render.viewer.html import write_viewer

pytestmark = pytest.mark.browser

MiB = 1 << 20


def _raw(name: str) -> Any:
    return pickle.loads((DATA / name).read_bytes())  # plain containers only (tests/data/README.md)


def _running_peak(trace: list[dict[str, Any]]) -> tuple[int, int]:
    """(position, bytes) of the first maximum of allocated bytes over a trace recorded from empty,
    summed here from its alloc and free_completed entries; position = entries applied."""
    live, best, pos = 0, 0, 0
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            live += e["size"]
        elif e["action"] == "free_completed":
            live -= e["size"]
        if live > best:
            best, pos = live, i + 1
    return pos, best


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    opened: list[Page] = []

    def open_(html: Path) -> Page:
        p = Page(browser, html)
        opened.append(p)
        return p

    yield open_
    for p in opened:
        p.close()


def _click_event(p: Page, pos: int) -> None:
    """Click the timeline in the middle of the pixel columns that show state position ``pos``."""
    v = p.js("window.__torchmem.view()")
    box = p.page.locator("#timeline").bounding_box()
    x = v["ml"] + (pos + 0.5 - v["x0"]) / (v["x1"] - v["x0"]) * v["W"]
    p.page.mouse.click(box["x"] + x * box["width"] / v["cw"], box["y"] + box["height"] / 2)
    # a click waits out the double-click delay, then opens the state tab
    p.page.wait_for_selector("#tab-state.on", timeout=5000)
    p.settle()


def test_timeline_click_opens_the_allocator_state_at_that_entry(page: Any, tmp_path: Path) -> None:
    name = "DeComFL__memory.pickle"  # complete trace from an empty device (README)
    trace = _raw(name)["device_traces"][0]
    pos, peak = _running_peak(trace)
    p = page(write_viewer(load_snapshot(DATA / name), tmp_path / "d.html"))
    pg = p.page
    # zoom to 80 entries around the peak, so that each entry is ~15 pixels wide
    pg.fill("#range-from", str(pos - 40))
    pg.fill("#range-to", str(pos + 40))
    pg.click("#range-apply")
    p.settle()
    assert pg.locator("#tab-timeline").is_visible()
    _click_event(p, pos)
    # the click switched to the Allocator State History tab, at the clicked entry
    assert pg.locator("#tab-state").is_visible() and not pg.locator("#tab-timeline").is_visible()
    assert pg.locator("#tabs button.on").inner_text() == "Allocator State History"
    assert int(pg.input_value("#ev-num")) == pos
    entry = trace[pos - 1]
    desc = pg.inner_text("#ev-desc")
    assert desc.startswith(f"after #{pos - 1}: {entry['action']} ") and hex(entry["addr"]) in desc
    assert pg.locator("#ev-list .sel").inner_text().startswith(f"#{pos - 1} alloc")
    m = p.js("window.__torchmem.mapStats()")
    assert (m["segments"], m["blocks"]) == _replay(trace, pos)[:2]
    # one numbering: the peak the Stats tab names is the same 0-based entry index
    p.js("window.__torchmem.showTab('stats')")
    cell = pg.locator("#stats-table td[data-key=peak_event]")
    assert int(cell.get_attribute("data-value")) == pos - 1
    got = pg.locator("#stats-table td[data-key=peak_allocated_bytes]").get_attribute("data-value")
    assert int(got) == peak
    p.check_offline_and_clean()


def _two_devices(first: str, second: str) -> dict[str, Any]:
    """Two real single-GPU snapshots as cuda:0 and cuda:1 of one file."""
    a, b = _raw(first), copy.deepcopy(_raw(second))
    for s in b["segments"]:
        s["device"] = 1
    return {"segments": a["segments"] + b["segments"],
            "device_traces": [a["device_traces"][0], b["device_traces"][0]],
            "allocator_settings": a.get("allocator_settings")}


def _allocated(raw: dict[str, Any], device: int) -> int:
    return sum(b["size"] for s in raw["segments"] if s["device"] == device for b in s["blocks"]
               if b["state"] == "active_allocated")


def test_multi_gpu_opens_on_the_device_with_the_oom(page: Any, tmp_path: Path) -> None:
    snap = _two_devices("notHanmin_a2__memory_snapshot_forward.pickle", "DeComFL__memory.pickle")
    t1 = snap["device_traces"][1]
    oom = {"action": "oom", "addr": 0, "size": 3 * 1024 * MiB, "device_free": 5 * MiB,
           "stream": 0, "time_us": t1[-1]["time_us"] + 10,
           "frames": [{"name": "train_step", "filename": "/src/train.py", "line": 42}]}
    t1.append(oom)
    src = tmp_path / "two.pickle"
    src.write_bytes(pickle.dumps(snap, protocol=4))
    # cuda:0 has the larger peak (its end state alone exceeds cuda:1's whole peak), yet the OOM
    # is on cuda:1: the page opens there
    assert _allocated(snap, 0) > _running_peak(t1)[1]
    p = page(write_viewer(load_snapshot(src), tmp_path / "two.html"))
    pg = p.page
    assert pg.input_value("#device") == "1"
    st = p.js("window.__torchmem.stats()")
    assert (st["device"], st["events"]) == (1, len(t1))
    options = pg.locator("#device option")
    assert options.nth(0).get_attribute("data-oom") is None and "OOM" not in options.nth(0).inner_text()
    assert options.nth(1).get_attribute("data-oom") == "1" and options.nth(1).inner_text().endswith("OOM")
    assert pg.inner_text("#dev-hint") == "cuda:1 ran out of memory"
    p.js("window.__torchmem.showTab('stats')")
    text = pg.inner_text("#stats")
    assert f"#{len(t1) - 1}\t3.00 GiB\t5.00 MiB" in text and "train_step" in text
    # switching by hand still works and shows the other file
    pg.select_option("#device", "0")
    p.settle()
    assert p.js("window.__torchmem.stats()")["events"] == len(snap["device_traces"][0])
    p.check_offline_and_clean()


def test_multi_gpu_without_oom_opens_on_the_largest_peak(page: Any, tmp_path: Path) -> None:
    snap = _two_devices("DeComFL__memory.pickle", "notHanmin_a2__memory_snapshot_forward.pickle")
    src = tmp_path / "two.pickle"
    src.write_bytes(pickle.dumps(snap, protocol=4))
    # cuda:1's end state alone is larger than cuda:0's whole peak (a trace from empty)
    assert _allocated(snap, 1) > _running_peak(snap["device_traces"][0])[1]
    p = page(write_viewer(load_snapshot(src), tmp_path / "two.html"))
    assert p.page.input_value("#device") == "1"
    assert p.js("window.__torchmem.stats()")["device"] == 1
    assert all("OOM" not in t for t in p.page.locator("#device option").all_inner_texts())
    assert p.page.inner_text("#dev-hint") == "cuda:1 has the largest peak"
    p.check_offline_and_clean()


def _rows(p: Page) -> list[tuple[int, str, int]]:
    """(segment number, address, size in bytes) of the rows the Segments tab has in the page."""
    return [(int(i), a, int(v)) for i, a, v in p.js(
        "[...document.querySelectorAll('#seg-body tr.seg')].map(r => [r.dataset.i, "
        "r.cells[1].textContent, r.cells[2].dataset.v])")]


def test_segments_tab_sorts_filters_and_draws_only_what_is_visible(page: Any, tmp_path: Path) -> None:
    name = "notHanmin_a2__memory_snapshot_forward.pickle"  # 1,722 segments (README)
    raw = _raw(name)
    segs = sorted(raw["segments"], key=lambda s: s["address"])  # the tab's numbering
    n = len(segs)
    assert n == 1722
    p = page(write_viewer(load_snapshot(DATA / name), tmp_path / "s.html"))
    pg = p.page
    pg.click("#tabs button[data-tab=segments]")
    p.settle()
    height = p.js("document.documentElement.scrollHeight")
    assert height <= 850  # the page fits the window (it was ~41,000 px tall)
    info = p.js("window.__torchmem.segments()")
    assert (info["total"], info["shown"]) == (n, n)
    rows = _rows(p)
    assert 10 < len(rows) < 100
    assert rows[0] == (0, hex(segs[0]["address"]), segs[0]["total_size"])
    # scroll to the end: the last segment is drawn, and still only a window of rows
    box = pg.locator("#seg-scroll")
    box.hover()
    for _ in range(3):
        pg.mouse.wheel(0, 20000)
    box.evaluate("b => { b.scrollTop = b.scrollHeight; }")
    p.settle()
    rows = _rows(p)
    assert rows[-1] == (n - 1, hex(segs[-1]["address"]), segs[-1]["total_size"]) and len(rows) < 100
    # sort by size, largest first (ties in address order), then smallest first
    pg.click("#seg-head th[data-sort=size]")
    p.settle()
    by_size = sorted(range(n), key=lambda i: (-segs[i]["total_size"], i))
    assert p.js("window.__torchmem.segments()")["order"] == by_size[:50]
    assert [r[0] for r in _rows(p)][:20] == by_size[:20]
    pg.click("#seg-head th[data-sort=size]")
    p.settle()
    assert [r[0] for r in _rows(p)][:20] == sorted(range(n), key=lambda i: (segs[i]["total_size"], i))[:20]
    # sort by allocated bytes (summed here from the blocks), largest first
    pg.click("#seg-head th[data-sort=alloc]")
    p.settle()
    alloc = [sum(b["size"] for b in s["blocks"] if b["state"] == "active_allocated") for s in segs]
    assert [r[0] for r in _rows(p)][:20] == sorted(range(n), key=lambda i: (-alloc[i], i))[:20]
    # filter: the small pool, then one address, then a function name from the blocks' stacks
    pg.select_option("#seg-pool", "small")
    p.settle()
    small = [i for i in range(n) if segs[i]["segment_type"] == "small"]
    assert p.js("window.__torchmem.segments()")["shown"] == len(small)
    assert sorted(r[0] for r in _rows(p)) == sorted(small)
    assert f"{len(small)} of {n} segments" in pg.inner_text("#seg-summary")
    pg.select_option("#seg-pool", "")
    pg.fill("#seg-filter", hex(segs[777]["address"]))
    p.settle()
    assert [r[0] for r in _rows(p)] == [777]

    def names(s: dict[str, Any]) -> str:
        return " ".join(f"{f['name']} {f['filename']}" for b in s["blocks"]
                        if b["state"] != "inactive" for f in b.get("frames") or []).lower()

    texts = [names(s) for s in segs]
    word = "scaled_dot_product_attention"
    want = [i for i in range(n) if word in texts[i]]
    assert 0 < len(want) < n
    pg.fill("#seg-filter", word)
    p.settle()
    assert p.js("window.__torchmem.segments()")["shown"] == len(want)
    pg.fill("#seg-filter", "")
    p.settle()
    assert p.js("window.__torchmem.segments()")["shown"] == n
    p.check_offline_and_clean()


def test_tracked_cpu_run_categories_legend_hover_and_stats(
    page: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torchmem
    from torchmem.io import load_trace
    from torchmem.model.events import EventKind

    model, opt, step = cpu_training("Adam")  # Adam: optimizer state as a category too
    with torchmem.track(model, opt, stacks=True) as tr:
        step()
        step()
    src = tmp_path / "run.tmtrace"
    tr.save(src)
    # what the file says, walked here: allocations in order, the peak and what is live there
    events = [e for e in load_trace(src).events() if e.kind in (EventKind.ALLOC, EventKind.FREE)]
    allocs = [e for e in events if e.kind is EventKind.ALLOC]
    live: dict[int, Any] = {}
    peak, at_peak, total = 0, {}, 0
    for e in events:
        if e.kind is EventKind.ALLOC:
            live[e.storage] = e
        else:
            live.pop(e.storage)
        total += e.signed_bytes
        if total > peak:
            peak, at_peak = total, dict(live)
    cats_peak: dict[str, int] = {}
    for e in at_peak.values():
        cats_peak[e.category.label] = cats_peak.get(e.category.label, 0) + e.nbytes
    cats_end: dict[str, int] = {}
    for e in live.values():
        cats_end[e.category.label] = cats_end.get(e.category.label, 0) + e.nbytes

    p = page(write_viewer(load_snapshot(src), tmp_path / "run.html"))
    pg = p.page
    assert pg.input_value("#colorby") == "category"
    legend = {el.get_attribute("data-cat"): int(el.get_attribute("data-peak"))
              for el in pg.locator("#tl-legend .item").all()}
    assert set(legend) == {e.category.label for e in allocs}
    assert {k: v for k, v in legend.items() if v} == cats_peak
    # a band's pixels have its category's legend colour; hovering it shows category/phase/module
    band = p.js("window.__torchmem.findBand(true)")
    ev = allocs[band["id"]]
    assert int(band["size"]) == ev.nbytes
    v = p.js("window.__torchmem.view()")
    box = pg.locator("#timeline").bounding_box()
    cx = round((band["x"] - box["x"]) * v["cw"] / box["width"])
    cy = round((band["y"] - box["y"]) * p.js("document.getElementById('timeline').height") / box["height"])
    rgb = p.js(f"[...document.getElementById('timeline').getContext('2d').getImageData({cx}, {cy}, 1, 1).data].slice(0, 3)")
    swatch = pg.locator(f"#tl-legend .item[data-cat={ev.category.label}] .sw").evaluate(
        "e => getComputedStyle(e).backgroundColor")
    assert swatch == "rgb({}, {}, {})".format(*rgb)
    pg.mouse.move(band["x"], band["y"])
    pg.locator("#tooltip").wait_for(state="visible", timeout=3000)
    tip = pg.inner_text("#tooltip")
    assert f"category {ev.category.label}" in tip and f"phase {ev.phase.label}" in tip
    if ev.module:
        assert f"module {ev.module}" in tip
    # one numbering: the tooltip's "allocated at event #k" is line k of `torchmem trace`
    k = p.js(f"window.__torchmem.allocInfo({band['id']})")["start"]
    assert f"allocated at event #{k} " in tip
    capsys.readouterr()
    assert main(["trace", str(src)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.split()[:1] == [str(k)])
    assert " alloc " in line and hex(int(band["addr"])) in line
    # colour by stack instead: the band's colour changes, the legend says so
    pg.select_option("#colorby", "stack")
    p.settle()
    assert "allocating stack" in pg.inner_text("#tl-legend")
    # the Stats tab: the storages' own figures, none of the allocator's zeros
    pg.click("#tabs button[data-tab=stats]")
    stats = pg.locator("#stats")

    def val(table: str, key: str) -> int:
        return int(stats.locator(f"#{table} td[data-key='{key}']").get_attribute("data-value"))

    assert val("stats-table", "peak_bytes") == peak
    assert val("stats-table", "live_end_bytes") == sum(e.nbytes for e in live.values())
    assert val("stats-table", "storages_end") == len(live)
    assert val("stats-table", "allocations") == len(allocs)
    assert val("stats-table", "frees") == len(events) - len(allocs)
    for cat, b in cats_peak.items():
        assert val("stats-category", f"{cat}:peak") == b
    for cat, b in cats_end.items():
        assert val("stats-category", f"{cat}:end") == b
    keys = set(p.js("[...document.querySelectorAll('#stats td[data-key]')].map(e => e.dataset.key)"))
    cuda_only = {"reserved_bytes", "free_bytes", "largest_free_block", "fragmentation",
                 "rounding_slack_bytes", "pending_free_bytes", "expandable_segments"}
    assert keys and not keys & cuda_only
    assert "simulator diverged" not in stats.inner_text()
    p.check_offline_and_clean()


def test_times_count_from_the_start_and_axes_start_at_zero(page: Any, tmp_path: Path) -> None:
    name = "DeComFL__memory.pickle"
    trace = _raw(name)["device_traces"][0]
    times = [e["time_us"] for e in trace]
    t0 = min(times)
    pos, _ = _running_peak(trace)
    p = page(write_viewer(load_snapshot(DATA / name), tmp_path / "t.html"))
    pg = p.page
    ticks = p.js("window.__torchmem.view()")["ticks"]
    assert ticks["y"][0] == "0 B" and ticks["x"][0] == "0"
    pg.select_option("#xmode", "time")
    p.settle()
    v = p.js("window.__torchmem.view()")
    assert v["x0"] == 0 and float(v["ticks"]["x"][0]) == 0.0
    assert float(pg.input_value("#range-from")) == 0.0
    assert float(pg.input_value("#range-to")) >= (max(times) - t0) / 1e6
    # the state at an entry says its time in seconds from the start
    k = len(trace) // 3
    p.js(f"window.__torchmem.showTab('state'); window.__torchmem.selectEvent({k})")
    assert f"(t={(times[k - 1] - t0) / 1e6:.4f} s)" in pg.inner_text("#ev-desc")
    # the Stats tab: the peak's time from the start, never a raw epoch timestamp
    p.js("window.__torchmem.showTab('stats')")
    got = float(pg.locator("#stats-table td[data-key=peak_time_s]").get_attribute("data-value"))
    assert got == pytest.approx((times[pos - 1] - t0) / 1e6, abs=1e-9)
    text = pg.inner_text("#stats")
    assert str(t0)[:8] not in text and "peak_time_us" not in text
    p.check_offline_and_clean()


def test_time_axis_starts_at_0_when_streams_interleave(page: Any, tmp_path: Path) -> None:
    """Entries of two streams can be recorded slightly out of time order: when the first entry
    is not the earliest, the time axis still starts at 0 (the earliest entry, the run's start)."""
    raw = _raw("MAGMA27_a2__memory_snapshot.pickle")
    trace = raw["device_traces"][0]
    trace[0]["time_us"] = trace[1]["time_us"] + 2500  # the first entry now 2.5 ms after the second
    src = tmp_path / "late.pickle"
    src.write_bytes(pickle.dumps(raw, protocol=4))
    p = page(write_viewer(load_snapshot(src), tmp_path / "late.html"))
    p.page.select_option("#xmode", "time")
    p.settle()
    v = p.js("window.__torchmem.view()")
    assert v["x0"] == 0 and float(v["ticks"]["x"][0]) == 0.0
    t0 = min(e["time_us"] for e in trace)
    p.js("window.__torchmem.showTab('state'); window.__torchmem.selectEvent(1)")
    assert f"(t={(trace[0]['time_us'] - t0) / 1e6:.4f} s)" in p.page.inner_text("#ev-desc")
    p.check_offline_and_clean()
