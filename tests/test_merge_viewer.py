"""`torchmem view` of a job's rank traces: one page, a rank selector, every rank's live bytes on
the job's one time axis. Checked against the traces (a plain replay written here) and, in a real
headless Chromium, the page itself."""

from __future__ import annotations

import base64
import json
import re
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest

from test_merge import _hand_rank, random_rank
from torchmem.analysis import rank_stats
from torchmem.cli import main
from torchmem.io.tmtrace import load_trace, save_trace
from torchmem.model.events import EventKind as K
from torchmem.model.trace import Trace
from torchmem.render.viewer._ranks import build_rank_payload, rank_curve

START = 1_800_000_000_000_000_000  # ns


def _job(tmp: Path, world: int = 3, n: int = 500, skip: tuple[int, ...] = ()) -> list[Path]:
    paths = []
    for r in range(world):
        if r in skip:
            continue
        tr = random_rank(r, world, n, seed=r)
        tr.metadata["start_unix_ns"] = START + r * 7_000_000  # rank r started 7 ms after rank 0
        p = tmp / f"job.rank{r}.tmtrace"
        save_trace(tr, p)
        paths.append(p)
    return paths


def _payload(html: Path) -> dict[str, Any]:
    data = re.search(r'<script id="payload" type="application/octet-stream">([^<]*)</script>',
                     html.read_text("utf-8"))
    assert data is not None
    raw = zlib.decompress(base64.b64decode(data.group(1)))
    n = struct.unpack("<I", raw[:4])[0]
    head: dict[str, Any] = json.loads(raw[4 : 4 + n])
    return head


def _live_by_time(tr: Trace) -> list[tuple[int, int]]:
    """(time in us, live bytes after the event): a plain replay of the events."""
    live, out = 0, []
    for e in tr.events():
        live += e.signed_bytes
        out.append((e.time_ns // 1000, live))
    return out


def test_curve_keeps_every_peak_of_a_plain_replay() -> None:
    tr = random_rank(0, 1, 3000, seed=4)
    for i in range(len(tr)):
        tr.time_ns[i] = i * 1000 + 17  # one event per microsecond
    t, live = rank_curve(tr, "cpu", points=50)
    truth = _live_by_time(tr)
    assert (t[0], live[0]) == (0, 0) and len(t) <= 52
    assert max(live) == max(v for _, v in truth)
    for k in range(1, len(t)):  # each point: the highest live bytes from its time to the next
        end = t[k + 1] if k + 1 < len(t) else 10**12
        assert live[k] == max(v for tt, v in truth if t[k] <= tt < end)


def test_payload_places_ranks_on_one_time_axis() -> None:
    traces = []
    for r in range(2):
        tr = _hand_rank(r)
        tr.metadata["start_unix_ns"] = START + r * 3_000_000
        traces.append(tr)
    p = build_rank_payload(traces)
    assert [d["name"] for d in p["devices"]] == ["rank 0 (cpu)", "rank 1 (cpu)"]
    # where each rank peaked: the hand-built ranks reach their peak with the 64 B aten::add
    assert [d["peak_at"] for d in p["devices"]] == ["other, step 0, aten::add in Net.l0"] * 2
    assert [(r["rank"], r["peak"], r["detail"], r["offset_us"]) for r in p["ranks"]] == [
        (0, 7564, 0, 0), (1, 5864, 1, 3000)]
    assert p["world_size"] == 2 and p["notes"] == []
    # the hand-built events are at 0..5 ns: rank 1's curve starts 3 ms after rank 0's
    assert p["ranks"][1]["t"][0] == 3000 and max(p["ranks"][1]["live"]) == 5864
    for d, r in zip(p["devices"], p["ranks"]):
        assert d["t_end_us"] == 3000 and min(d["columns"]["ev_time"]) == r["offset_us"]
    only = build_rank_payload([_hand_rank(0), _hand_rank(1)], detail=[1])
    assert [d["rank"] for d in only["devices"]] == [1]
    assert [r["detail"] for r in only["ranks"]] == [-1, 0]
    assert only["notes"] and "start_unix_ns" in only["notes"][0]


def test_cli_view_of_a_rank_set(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _job(tmp_path, world=4, skip=(2,))
    assert main(["view", str(tmp_path / "job.rank*.tmtrace"), "-q"]) == 0
    cap = capsys.readouterr()
    out = tmp_path / "job.ranks.html"
    assert f"wrote {out}" in cap.out and "MISSING rank(s) 2" in cap.err
    p = _payload(out)
    assert [r["rank"] for r in p["ranks"]] == [0, 1, 3] and p["world_size"] == 4
    assert [d["rank"] for d in p["devices"]] == [0, 1, 3]
    assert [r["offset_us"] for r in p["ranks"]] == [0, 7000, 21000]
    html = out.read_text("utf-8")
    assert "function setupRanks" in html
    sub = tmp_path / "sub.html"
    assert main(["view", str(tmp_path / "job.rank*.tmtrace"), "--ranks", "3", "-o", str(sub),
                 "-q"]) == 0
    assert [d["rank"] for d in _payload(sub)["devices"]] == [3]
    capsys.readouterr()
    assert main(["view", str(tmp_path / "job.rank*.tmtrace"), "--ranks", "2"]) == 2
    assert "not among the traces given" in capsys.readouterr().err
    assert main(["view", str(tmp_path / "job.rank*.tmtrace"), "--ranks", "x"]) == 2
    assert "--ranks expects rank numbers" in capsys.readouterr().err


def test_single_file_page_carries_no_rank_code(tmp_path: Path) -> None:
    p = _job(tmp_path, world=2)[0]
    assert main(["view", str(p), "-o", str(tmp_path / "one.html"), "-q"]) == 0
    page = (tmp_path / "one.html").read_text("utf-8")
    assert "function setupRanks" not in page and '"ranks"' not in json.dumps(_payload(tmp_path / "one.html"))


@pytest.mark.browser
def test_rank_page_in_chromium(tmp_path: Path) -> None:
    from test_viewer_browser import CHROMIUM, Page, _nonblank_fraction

    sync_api = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.skip("needs Debian's chromium at /usr/bin/chromium")
    _job(tmp_path, world=3, n=800)
    assert main(["view", str(tmp_path / "job.rank*.tmtrace"), "-q"]) == 0
    with sync_api.sync_playwright() as pw:
        from test_viewer_browser import ARGS

        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = Page(browser, tmp_path / "job.ranks.html")
        try:
            page.check_offline_and_clean()
            r = page.js("window.__torchmem.ranks()")
            assert (r["count"], r["world"], r["mode"], r["curves"]) == (3, 3, "time", 3)
            assert page.page.locator("label.dev").inner_text().startswith("rank")
            options = page.page.locator("#device option").all_inner_texts()
            want = [rank_stats(load_trace(tmp_path / f"job.rank{i}.tmtrace")).peak_at
                    for i in range(3)]
            assert [o.split(" in ", 1)[1].rstrip(")") for o in options] == want
            first = r["current"]
            page.js("window.__torchmem.setView(5000, 20000)")
            other = next(i for i in range(3) if i != first)
            s = page.js(f"window.__torchmem.selectDevice({other})")
            assert s["current"] == other and (s["x0"], s["x1"]) == (5000, 20000)
            assert s["curves"] == 3 and s["mode"] == "time"
            frac, colors = _nonblank_fraction(page.page.locator("#timeline").screenshot())
            assert frac > 0.05 and colors >= 3
            assert "3 rank curves on one time axis" in page.page.locator(
                "#timeline-summary").inner_text()
            page.check_offline_and_clean()
        finally:
            page.close()
            browser.close()


def test_rank_traces_must_be_one_job(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = tmp_path / "a.rank0.tmtrace"
    save_trace(random_rank(0, 2, 100, 0, job="a"), a)
    b = tmp_path / "b.rank1.tmtrace"
    save_trace(random_rank(1, 2, 100, 0, job="b"), b)
    assert main(["view", str(a), str(b), "-q"]) == 2
    assert "not from the same job" in capsys.readouterr().err
    plain = tmp_path / "plain.tmtrace"
    tr = Trace()
    tr.append(K.ALLOC, 0, "cpu", 8, 1)
    save_trace(tr, plain)
    assert main(["view", str(a), str(plain), "-q"]) == 2
    assert "expected an integer 'rank'" in capsys.readouterr().err
