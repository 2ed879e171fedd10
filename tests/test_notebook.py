"""torchmem in Jupyter: a real notebook executed in a real kernel (nbclient + ipykernel), its
outputs checked against figures computed here another way, and its HTML opened in headless
Chromium (no JavaScript error, no network request, the embedded viewer draws).

Ground truth: byte counts hand-computed from tensor shapes; the real snapshot's reserved and
allocated bytes summed from the pickle's own segments; the estimate called directly here.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest

from torchmem.units import format_bytes

# one worker runs this file (bash scripts/test.sh: pytest -n auto --dist loadgroup): its module
# fixtures and caches are built once, not once per worker
pytestmark = pytest.mark.xdist_group("notebook")

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
SNAP = DATA / "DeComFL__memory.pickle"

BUILD = '''
def build(batch):
    net = torch.nn.Linear(1024, 1024)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.randn(batch, 1024, device="cuda")
    def step():
        net.to("cuda")(x).sum().backward(); opt.step(); opt.zero_grad()
    return step
'''

CELLS: list[tuple[str, list[str]]] = [
    ("%%torchmem\nx = 1", ["raises-exception"]),  # 0: before %load_ext
    ("%load_ext torchmem", []),  # 1
    ("import torch, torchmem", []),  # 2
    (  # 3: peak = 1 MiB (x) + 512 KiB (y) = 1.50 MiB; z (256 KiB) comes after y is freed
        "%%torchmem --name tr -o {OUT}\n"
        "x = torch.zeros(1 << 18)\n"
        "y = torch.ones(1 << 17)\n"
        "del y\n"
        "z = torch.zeros(1 << 16)\n",
        [],
    ),
    ("tr.peak()", []),  # 4
    ("%torchmem_snapshot", []),  # 5
    ("torchmem.inspect_memory(torch.nn.Linear(256, 256))", []),  # 6
    (f"snap = torchmem.load_snapshot({str(SNAP)!r})\nsnap", []),  # 7
    (BUILD + "\ntorchmem.estimate(build, gpu='T4', batch_size=8)", []),  # 8
    ("torchmem.analysis.summarize(tr.trace)", []),  # 9
    ("%torchmem_snapshot 42", ["raises-exception"]),  # 10
    ("%%torchmem --top 0\nx = 1", ["raises-exception"]),  # 11
    ("%torchmem_snapshot snap --height 500", []),  # 12
    ("%%torchmem\nw = torch.zeros(100)\nraise ValueError('boom')", ["raises-exception"]),  # 13
    ("%%torchmem\nv = torch.ones(10)\nv.sum()", []),  # 14
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("nb") / "cell.tmtrace"


@pytest.fixture(scope="module")
def executed(saved: Path) -> Any:
    nb = nbformat.v4.new_notebook()
    for src, tags in CELLS:
        cell = nbformat.v4.new_code_cell(src.replace("{OUT}", str(saved)))
        if tags:
            cell.metadata["tags"] = tags
        nb.cells.append(cell)
    env_path = os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = env_path  # the kernel imports this checkout's torchmem
    try:
        client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                         resources={"metadata": {"path": str(ROOT)}})
        client.execute()
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old
    return nb


def _html(cell: Any) -> str:
    return "".join(o["data"]["text/html"] for o in cell.outputs
                   if o.get("output_type") in ("display_data", "execute_result")
                   and "text/html" in o.get("data", {}))


def _error(cell: Any) -> str:
    """The cell's error: IPython prints a UsageError on stderr (no traceback), others as errors."""
    errs = [o for o in cell.outputs if o.get("output_type") == "error"]
    if errs:
        return f"{errs[0]['ename']}: {errs[0]['evalue']}"
    err = "".join(o["text"] for o in cell.outputs
                  if o.get("output_type") == "stream" and o.get("name") == "stderr")
    assert err, cell.outputs
    return err.strip()


def test_magic_without_the_extension_says_so(executed: Any) -> None:
    assert _error(executed.cells[0]) == "UsageError: Cell magic `%%torchmem` not found."


def test_cell_magic_shows_tables_and_timeline(executed: Any) -> None:
    page = _html(executed.cells[3])
    peak = (1 << 18) * 4 + (1 << 17) * 4  # 1.50 MiB
    assert f"peak {format_bytes(peak)}" in page  # the heading and the timeline's label
    assert "<svg" in page and "live tensor memory over time" in page
    assert "<td>aten::zeros</td>" in page and "<td>aten::ones</td>" not in page.split(
        "operators live at the peak")[0]  # the overview table names no operator
    # what is live at the peak: zeros (x) and ones (y), 1 MiB and 512 KiB
    ops = page.split("operators live at the peak")[1].split("</table>")[0]
    assert f"<td>aten::zeros</td><td class=\"num\">{format_bytes(1 << 20)}</td>" in ops
    assert f"<td>aten::ones</td><td class=\"num\">{format_bytes(1 << 19)}</td>" in ops
    # the Tracker was kept with --name
    assert executed.cells[4].outputs[0]["data"]["text/plain"] == f"{{'cpu': {peak}}}"


def test_cell_magic_saves_the_trace(executed: Any, saved: Path) -> None:
    from torchmem.io import load_trace

    assert load_trace(saved).peak() == {"cpu": (1 << 18) * 4 + (1 << 17) * 4}


def test_rich_display_of_report_snapshot_estimate_summary(executed: Any) -> None:
    report = _html(executed.cells[6])
    assert "torchmem MemoryReport: 2 storages" in report
    assert format_bytes(256 * 256 * 4 + 256 * 4) in report  # 257.00 KiB of parameters

    raw = pickle.loads(SNAP.read_bytes())
    snap = _html(executed.cells[7])
    reserved = sum(s["total_size"] for s in raw["segments"])
    allocated = sum(b["size"] for s in raw["segments"] for b in s["blocks"]
                    if b["state"] == "active_allocated")
    assert f'<td class="num">{format_bytes(reserved)}</td>' in snap
    assert f'<td class="num">{format_bytes(allocated)}</td>' in snap
    assert f'<td class="num">{len(raw["segments"])}</td>' in snap

    import torch

    import torchmem

    ns: dict[str, Any] = {"torch": torch}
    exec(BUILD, ns)
    est = torchmem.estimate(ns["build"], gpu="T4", batch_size=8)
    page = _html(executed.cells[8])
    assert "T4, batch 8: FITS" in page
    assert f"<td>peak reserved</td><td class=\"num\">{format_bytes(est.peak_reserved_bytes)}" in page
    assert f"headroom {format_bytes(est.headroom_bytes)}" in page

    summary = _html(executed.cells[9])
    assert "torchmem trace summary (cpu, peak 1.50 MiB)" in summary


def test_cell_magic_keeps_errors_and_the_last_value(executed: Any) -> None:
    failed = executed.cells[13]
    assert _error(failed) == "ValueError: boom"  # the cell fails: Run All stops there
    assert f"peak {format_bytes(400)}" in _html(failed)  # and the tables are still shown
    out = [o for o in executed.cells[14].outputs if o["output_type"] == "execute_result"]
    assert out[0]["data"]["text/plain"] == "tensor(10.)"
    assert f"peak {format_bytes(40 + 4)}" in _html(executed.cells[14])  # ones(10), the sum


def test_bad_input_to_the_magics(executed: Any) -> None:
    assert _error(executed.cells[10]).startswith(
        "UsageError: %torchmem_snapshot: the viewer expected a memory snapshot")
    assert "got int" in _error(executed.cells[10])
    assert _error(executed.cells[11]) == (
        "UsageError: %%torchmem --top expects a whole number >= 1, got 0")


@pytest.mark.browser
def test_html_outputs_open_in_chromium_offline(executed: Any, browser: Any,
                                               tmp_path: Path) -> None:
    body = "".join(f'<section id="cell{i}">{_html(c)}</section>'
                   for i, c in enumerate(executed.cells))
    out = tmp_path / "notebook.html"
    out.write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>nb</title></head>"
                   f"<body>{body}</body></html>", encoding="utf-8")
    url = out.resolve().as_uri()
    requests: list[str] = []
    errors: list[str] = []
    page = browser.new_page(viewport={"width": 1300, "height": 900})
    page.on("request", lambda r: requests.append(r.url))
    page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    try:
        page.goto(url)
        frames = page.locator("iframe.torchmem-viewer")
        assert frames.count() == 2  # cell 5 (the tracked cell) and cell 12 (the real snapshot)
        viewers = [f for f in page.frames if f is not page.main_frame]
        assert len(viewers) == 2
        for f in viewers:
            f.wait_for_selector("html[data-tm-ready], html[data-tm-error]", state="attached",
                                timeout=30000)
            assert f.evaluate("window.__torchmem.error") is None
        stats = [f.evaluate("window.__torchmem.stats()") for f in viewers]
        # the tracked cell allocated 3 storages (x, y, z): the viewer shows each one
        assert stats[0]["allocs"] == 3
        assert stats[1]["bands"] > 0
        # the SVG timeline drew one line with as many points as the trace has events (4 + 0)
        pts = page.locator("#cell3 svg.torchmem-timeline polyline").get_attribute("points")
        assert pts is not None and len(pts.split()) == 4
        foreign = [u for u in requests if u != url and not u.startswith(("data:", "about:"))]
        assert foreign == []
        assert errors == []
    finally:
        page.close()
