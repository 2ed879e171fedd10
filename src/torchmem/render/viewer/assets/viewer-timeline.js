  // ---------------------------------------------------------------- timeline
  const tl = { canvas: $('timeline'), x0: 0, x1: 1, ml: 78, mr: 12, mt: 10, mb: 30, pick: null, W: 0, H: 0,
    ymax: 1, colEvent: null, pending: false, rangeEdited: false };
  const DBLCLICK_MS = 250;  // a click waits this long for a second one before it opens the state
  // The view [x0, x1] is in event positions (mode 'event') or microseconds (mode 'time').
  tl.mode = 'event';
  function posOfTime(t) {  // states whose last event happened at or before t
    const tc = D.tcum;
    let lo = 0, hi = D.n_events;
    while (lo < hi) { const mid = (lo + hi) >> 1; if (tc[mid] <= t) lo = mid + 1; else hi = mid; }
    return lo;
  }
  function timeOfPos(p) { return p <= 0 ? D.tmin : D.tcum[Math.min(D.n_events, Math.ceil(p)) - 1]; }
  function domain() { return tl.mode === 'time' ? [D.tmin, D.tmax] : [0, D.N]; }
  function toPos(v) { return tl.mode === 'time' ? posOfTime(v) : v; }
  function setMode(mode) {
    if (mode === tl.mode || (mode === 'time' && !D.tcum)) return;
    const a = tl.x0, b = tl.x1;
    if (mode === 'time') { tl.x0 = timeOfPos(a); tl.x1 = Math.max(timeOfPos(b), tl.x0 + 1); }
    else { tl.x0 = posOfTime(a); tl.x1 = Math.max(posOfTime(b), tl.x0 + 2); }
    tl.mode = mode;
    tl.rangeEdited = false;  // the fields switch unit: show the view in the new one
    modeLabels();
    scheduleTimeline();
  }
  function modeLabels() {
    const mode = tl.mode;
    $('xmode').value = mode;
    $('range-unit').textContent = mode === 'time' ? 's' : '';
    $('range-label').textContent = mode === 'time' ? 'from time' : 'from event';
    for (const id of ['range-from', 'range-to']) $(id).step = mode === 'time' ? 'any' : '1';
  }
  function tlResize() {
    const cv = tl.canvas;
    const w = Math.max(300, cv.parentElement.clientWidth);
    if (cv.width !== w) cv.width = w;
    const h = Math.max(320, Math.min(900, window.innerHeight - 190));
    if (cv.height !== h) cv.height = h;
    tl.W = cv.width - tl.ml - tl.mr;
    tl.H = cv.height - tl.mt - tl.mb;
  }
  function scheduleTimeline() {
    if (tl.pending) return;
    tl.pending = true;
    requestAnimationFrame(() => { tl.pending = false; drawTimeline(); });
  }
  function drawTimeline() {
    const t0 = performance.now();
    tlResize();
    const d = D, W = tl.W, H = tl.H, n = d.n_events;
    const ctx = tl.canvas.getContext('2d');
    ctx.fillStyle = '#fff';
    ctx.fillRect(0, 0, tl.canvas.width, tl.canvas.height);
    const x0 = tl.x0, x1 = tl.x1, span = x1 - x0;
    // Column -> the state position with the largest total in its range (keeps peaks visible).
    const colPos = new Int32Array(W);
    let ymax = 1;
    const timeMode = tl.mode === 'time';
    for (let x = 0; x < W; x++) {
      let a, b;
      if (timeMode) { a = posOfTime(x0 + span * x / W); b = posOfTime(x0 + span * (x + 1) / W); }
      else { a = Math.floor(x0 + span * x / W); b = Math.floor(x0 + span * (x + 1) / W - 1e-9); }
      a = Math.min(Math.max(a, 0), n); b = Math.min(Math.max(b, a), n);
      let best = a, bv = d.total[a];
      for (let p = a + 1; p <= b; p++) if (d.total[p] > bv) { bv = d.total[p]; best = p; }
      colPos[x] = best;
      if (bv > ymax) ymax = bv;
    }
    if (P.ranks && timeMode) ymax = Math.max(ymax, rankCurvesMax(x0, x1));
    ymax *= 1.05;
    tl.ymax = ymax;
    tl.colEvent = colPos;
    const img = ctx.createImageData(W, H);
    const px = new Uint32Array(img.data.buffer);
    px.fill(PX_WHITE);
    const pick = (tl.pick && tl.pick.length === W * H) ? tl.pick : new Int32Array(W * H);
    pick.fill(-1);
    // Sweep positions forward keeping the live list in allocation (= stacking) order.
    const alive = d.alive, live = d.live, s = d.s, byEnd = d.byEnd, endStart = d.endStart, size = d.col.al_size;
    alive.fill(0);
    let nl = 0, nextStart = 0, endPtr = 0, processedEnd = -1;
    const nA = d.n_allocs;
    const bpp = ymax / H;
    const frame = ++d.frame;
    let bands = 0;
    const colorOf = d.colorOf, seen = d.seen;
    for (let x = 0; x < W; x++) {
      const p = colPos[x];
      while (nextStart < nA && s[nextStart] <= p) { alive[nextStart] = 1; live[nl++] = nextStart; nextStart++; }
      while (processedEnd < p) { processedEnd++; const lim = endStart[processedEnd + 1]; for (; endPtr < lim; endPtr++) alive[byEnd[endPtr]] = 0; }
      // Walk the live list bottom-up, compacting freed entries; each pixel row belongs to the
      // allocation that covers its centre (sub-pixel allocations merge into their neighbours).
      let w = 0, cum = 0, row = 0, center = bpp * 0.5;
      for (let i = 0; i < nl; i++) {
        const a = live[i];
        if (!alive[a]) continue;
        live[w++] = a;
        if (row >= H) continue;
        cum += size[a];
        const first = row;
        while (row < H && center < cum) {
          const idx = (H - 1 - row) * W + x;
          px[idx] = PAL_PX[colorOf[a]];
          pick[idx] = a;
          row++; center += bpp;
        }
        if (row > first) {
          if (seen[a] !== frame) { seen[a] = frame; bands++; }
          if (row - first >= 4) px[(H - row) * W + x] = PAL_DARK[colorOf[a]];
        }
      }
      nl = w;
    }
    ctx.putImageData(img, tl.ml, tl.mt);
    tl.pick = pick;
    drawAxes(ctx, ymax);
    const curves = P.ranks && timeMode ? drawRankCurves(ctx, ymax) : 0;
    const ms = performance.now() - t0;
    api._tl = { bands, columns: W, drawMs: ms, draws: api._tl.draws + 1, ymax, rankCurves: curves };
    if (api.firstDrawMs === null) api.firstDrawMs = performance.now() - T_START + (performance.timeOrigin ? 0 : 0);
    const from = Math.max(0, Math.floor(toPos(x0))), to = Math.min(n, Math.ceil(toPos(x1)));
    if (!tl.rangeEdited) {  // a redraw never overwrites a range the user is typing
      if (timeMode) { $('range-from').value = (x0 / 1e6).toFixed(6); $('range-to').value = (x1 / 1e6).toFixed(6); }
      else { $('range-from').value = from; $('range-to').value = to; }
    }
    let peak = 0, peakAt = 0;
    for (let p = from; p <= to; p++) if (d.total[p] > peak) { peak = d.total[p]; peakAt = p; }
    $('timeline-summary').innerHTML = 'events ' + from + '&ndash;' + to + ' of ' + n + ' &middot; ' + d.n_allocs + ' allocations (' + d.n_pre +
      ' from before the trace) &middot; peak in view <b>' + fmtBytes(peak) + '</b> after event #' + Math.max(0, peakAt - 1) +
      ' &middot; ' + bands + ' allocations drawn &middot; drawn in ' + ms.toFixed(0) + ' ms' +
      (d.has_time && n ? ' &middot; time ' + (d.col.ev_time[Math.min(from, n - 1)] / 1e6).toFixed(4) + ' s &ndash; ' + (d.col.ev_time[Math.max(0, Math.min(to, n) - 1)] / 1e6).toFixed(4) + ' s' : '') +
      (P.ranks ? ' &middot; ' + (timeMode ? curves + ' rank curves on one time axis (dark: rank ' + d.rank + ')' : 'x axis &rarr; time to compare the ranks') : '');
  }
  // The ranks of a job (P.ranks): each rank's live bytes over the job's time, [t, live] points.
  function rankCurvesMax(x0, x1) {
    let m = 0;
    for (const r of P.ranks) {
      const t = r.t, v = r.live;
      for (let i = 0; i < t.length; i++) {
        if (t[i] > x1) break;
        if (t[i] >= x0 || (i + 1 < t.length && t[i + 1] >= x0)) m = Math.max(m, v[i]);
      }
    }
    return m;
  }
  function drawRankCurves(ctx, ymax) {
    const { ml, mt, W, H } = tl, span = tl.x1 - tl.x0;
    let drawn = 0;
    ctx.save();
    ctx.beginPath(); ctx.rect(ml, mt, W, H); ctx.clip();
    const cur = P.ranks.find((r) => r.rank === D.rank);
    for (const r of [...P.ranks.filter((x) => x !== cur), cur]) {  // this rank's curve on top
      if (!r || r.t.length < 2) continue;
      const mine = r === cur;
      ctx.strokeStyle = mine ? '#111a2b' : 'rgba(70,80,100,.45)';
      ctx.lineWidth = mine ? 2 : 1;
      ctx.beginPath();
      let best = -1;
      for (let i = 0; i < r.t.length; i++) {
        const x = ml + (r.t[i] - tl.x0) / span * W, y = mt + H - r.live[i] / ymax * H;
        if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
        if (r.t[i] >= tl.x0 && r.t[i] <= tl.x1 && (best < 0 || r.live[i] > r.live[best])) best = i;
      }
      ctx.stroke();
      drawn++;
      if (best >= 0 && (mine || r.rank === P.rankHigh || r.rank === P.rankLow)) {
        ctx.fillStyle = mine ? '#111a2b' : '#505a6e'; ctx.textAlign = 'left'; ctx.textBaseline = 'bottom';
        const x = ml + (r.t[best] - tl.x0) / span * W;
        ctx.fillText('rank ' + r.rank, Math.min(x + 3, ml + W - 44), mt + H - r.live[best] / ymax * H - 2);
      }
    }
    ctx.restore();
    return drawn;
  }
  // The legend under the timeline: categories present, with the bytes live at the peak.
  function tlLegend() {
    const box = $('tl-legend'), cw = $('colorby-wrap');
    cw.style.display = D.hasOrigin ? '' : 'none';
    $('colorby').value = D.colorBy;
    if (D.colorBy !== 'category') {
      box.innerHTML = D.hasOrigin || D.n_allocs ? '<span class="muted">colour = allocating stack; hover a band for its stack</span>' : '';
      return;
    }
    const c = D.col, seen = new Set();
    for (let a = 0; a < D.n_allocs; a++) seen.add(c.al_cat[a]);
    const figs = ((D.stats || {}).tracked || {}).by_category || {};
    const html = [];
    for (let k = 0; k < CAT_COLORS.length; k++) {
      const code = k === CAT_COLORS.length - 1 ? -1 : k;
      if (!seen.has(code)) continue;
      const name = code >= 0 ? P.category_names[code] : 'unknown';
      const pk = figs[name] ? figs[name].peak : (D.stats && D.stats.tracked ? 0 : null);
      html.push('<span class="item" data-cat="' + esc(name) + '"' + (pk !== null ? ' data-peak="' + pk + '"' : '') + '><span class="sw" style="background:' +
        CAT_COLORS[k] + '"></span>' + esc(name) + (pk !== null ? ' <span class="muted">' + fmtBytes(pk) + ' at the peak</span>' : '') + '</span>');
    }
    box.innerHTML = '<span class="muted">colour = category:</span>' + html.join('');
  }
  function niceStep(range, target) {
    const raw = range / Math.max(1, target), mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const r = raw / mag;
    return (r < 1.5 ? 1 : r < 3 ? 2 : r < 7 ? 5 : 10) * mag;
  }
  function niceByteStep(range, target) {
    const raw = range / Math.max(1, target);
    let unit = 1;
    for (const u of [1099511627776, 1073741824, 1048576, 1024]) if (raw >= u) { unit = u; break; }
    return niceStep(raw * target / unit, target) * unit;
  }
  function drawAxes(ctx, ymax) {
    const { ml, mt, W, H } = tl;
    ctx.strokeStyle = '#8c96a8'; ctx.fillStyle = '#39414f'; ctx.font = '11px system-ui, sans-serif';
    ctx.beginPath(); ctx.moveTo(ml - 0.5, mt); ctx.lineTo(ml - 0.5, mt + H + 0.5); ctx.lineTo(ml + W, mt + H + 0.5); ctx.stroke();
    ctx.textAlign = 'right'; ctx.textBaseline = 'middle';
    const ys = niceByteStep(ymax, 6);
    for (let v = 0; v <= ymax; v += ys) {
      const y = mt + H - (v / ymax) * H;
      ctx.fillText(fmtBytes(v), ml - 6, y);
      ctx.beginPath(); ctx.moveTo(ml - 4, y + 0.5); ctx.lineTo(ml, y + 0.5); ctx.stroke();
    }
    ctx.textBaseline = 'top';
    tl.ticks = { y: [], x: [] };
    for (let v = 0; v <= ymax; v += ys) tl.ticks.y.push(fmtBytes(v));
    const span = tl.x1 - tl.x0, timeMode = tl.mode === 'time';
    const xs = timeMode ? niceStep(span, 8) : Math.max(1, niceStep(span, 8));
    const digits = timeMode ? Math.max(0, Math.min(6, -Math.floor(Math.log10(xs / 1e6) + 1e-9))) : 0;
    for (let v = Math.ceil(tl.x0 / xs) * xs; v <= tl.x1; v += xs) {
      const x = ml + (v - tl.x0) / span * W;
      ctx.textAlign = x > ml + W - 30 ? 'right' : 'center';
      const label = timeMode ? (v / 1e6).toFixed(digits) : String(Math.round(v));
      tl.ticks.x.push(label);
      ctx.fillText(label, x, mt + H + 6);
      ctx.beginPath(); ctx.moveTo(x + 0.5, mt + H); ctx.lineTo(x + 0.5, mt + H + 4); ctx.stroke();
    }
    ctx.textAlign = 'right';
    ctx.fillText(timeMode ? 'time (s)' : 'event #', ml + W, mt + H + 18);
    const pe = D.stats && D.stats.peak_event;  // 0-based trace entry after which the peak is reached
    if (pe !== undefined && pe !== null && D.n_events) {
      const x = ml + ((timeMode ? D.tcum[pe] : pe + 1) - tl.x0) / span * W;
      if (x >= ml && x <= ml + W) {
        ctx.save(); ctx.setLineDash([4, 3]); ctx.strokeStyle = '#1f2a3c';
        ctx.beginPath(); ctx.moveTo(x + 0.5, mt); ctx.lineTo(x + 0.5, mt + H); ctx.stroke(); ctx.restore();
        ctx.fillStyle = '#1f2a3c'; ctx.textAlign = x > ml + W - 60 ? 'right' : 'left'; ctx.textBaseline = 'top';
        ctx.fillText('peak ' + fmtBytes(D.stats.peak_allocated_bytes), x + (x > ml + W - 60 ? -4 : 4), mt + 2);
      }
    }
    for (const o of D.ooms) {  // out-of-memory events: a red line
      const x = ml + ((timeMode ? D.tcum[o.event] : o.event + 1) - tl.x0) / span * W;
      if (x < ml || x > ml + W) continue;
      ctx.strokeStyle = '#d00'; ctx.beginPath(); ctx.moveTo(x + 0.5, mt); ctx.lineTo(x + 0.5, mt + H); ctx.stroke();
      const right = x > ml + W - 40;
      ctx.fillStyle = '#d00'; ctx.textAlign = right ? 'right' : 'left'; ctx.textBaseline = 'top';
      ctx.fillText('OOM', x + (right ? -3 : 3), mt + 14);
    }
    if (tl.sel) {
      ctx.fillStyle = 'rgba(31,42,60,.15)';
      ctx.fillRect(Math.min(tl.sel[0], tl.sel[1]), mt, Math.abs(tl.sel[1] - tl.sel[0]), H);
    }
  }
  function posAt(clientX) {
    const r = tl.canvas.getBoundingClientRect();
    const x = (clientX - r.left) * (tl.canvas.width / r.width) - tl.ml;
    return tl.x0 + (x / tl.W) * (tl.x1 - tl.x0);
  }
  function setView(a, b) {
    const [lo, hi] = domain(), minSpan = tl.mode === 'time' ? Math.max(1, (hi - lo) / 1e6) : 2;
    let x0 = Math.max(lo, Math.min(a, b)), x1 = Math.min(hi, Math.max(a, b));
    if (x1 - x0 < minSpan) { const m = (x0 + x1) / 2; x0 = Math.max(lo, m - minSpan / 2); x1 = Math.min(hi, x0 + minSpan); }
    tl.x0 = x0; tl.x1 = x1;
    tl.rangeEdited = false;  // the fields show the new view again
    scheduleTimeline();
  }
  function tlPickAt(clientX, clientY) {
    const r = tl.canvas.getBoundingClientRect();
    const x = Math.floor((clientX - r.left) * (tl.canvas.width / r.width)) - tl.ml;
    const y = Math.floor((clientY - r.top) * (tl.canvas.height / r.height)) - tl.mt;
    if (x < 0 || y < 0 || x >= tl.W || y >= tl.H || !tl.pick) return -1;
    return tl.pick[y * tl.W + x];
  }
  function setupTimeline() {
    const cv = tl.canvas;
    let drag = null;
    cv.addEventListener('wheel', (ev) => {
      ev.preventDefault();
      const p = posAt(ev.clientX), f = ev.deltaY > 0 ? 1.25 : 0.8;
      setView(p - (p - tl.x0) * f, p + (tl.x1 - p) * f);
    }, { passive: false });
    cv.addEventListener('mousedown', (ev) => {
      drag = { x: ev.clientX, x0: tl.x0, x1: tl.x1, shift: ev.shiftKey, moved: false };
      if (ev.shiftKey) { const r = cv.getBoundingClientRect(); const cx = ev.clientX - r.left; tl.sel = [cx, cx]; }
    });
    window.addEventListener('mouseup', (ev) => {
      if (!drag) return;
      const d = drag; drag = null;
      if (d.shift) {
        tl.sel = null;
        if (Math.abs(ev.clientX - d.x) > 3) setView(posAt(d.x), posAt(ev.clientX)); else scheduleTimeline();
      } else if (!d.moved && ev.target === cv) {
        const v = posAt(ev.clientX);
        // A click opens the allocator state at that point, once it is clear that it is not the
        // first half of a double-click (which resets the zoom).
        const p = Math.max(0, Math.min(D.n_events, tl.mode === 'time' ? posOfTime(v) : Math.floor(v)));
        clearTimeout(tl.clickTimer);
        tl.clickTimer = ev.detail > 1 ? null : setTimeout(() => { tl.clickTimer = null; selectStateEvent(p); showTab('state'); }, DBLCLICK_MS);
      }
    });
    window.addEventListener('mousemove', (ev) => {
      if (drag) {
        if (Math.abs(ev.clientX - drag.x) > 3) drag.moved = true;
        if (drag.shift) {
          const r = cv.getBoundingClientRect(); tl.sel[1] = ev.clientX - r.left; scheduleTimeline();
        } else if (drag.moved) {
          const r = cv.getBoundingClientRect();
          const dp = (ev.clientX - drag.x) * (cv.width / r.width) / tl.W * (drag.x1 - drag.x0);
          let a = drag.x0 - dp, b = drag.x1 - dp;
          const [lo, hi] = domain();
          if (a < lo) { b += lo - a; a = lo; } if (b > hi) { a -= b - hi; b = hi; }
          setView(a, b);
        }
        hideTip();
        return;
      }
      if (ev.target !== cv) return;
      const id = tlPickAt(ev.clientX, ev.clientY);
      if (id >= 0) showTip(allocHtml(id), ev.clientX, ev.clientY); else hideTip();
    });
    cv.addEventListener('mouseleave', hideTip);
    const reset = () => { const [lo, hi] = domain(); setView(lo, hi); };
    cv.addEventListener('dblclick', () => { clearTimeout(tl.clickTimer); tl.clickTimer = null; reset(); });
    $('range-apply').addEventListener('click', () => {
      // Times are whole microseconds: round so that "1.250000 s" includes an event at 1250000 us.
      const conv = (v) => tl.mode === 'time' ? Math.round(+v * 1e6) : +v;
      setView(conv($('range-from').value), conv($('range-to').value));
    });
    $('range-reset').addEventListener('click', reset);
    $('xmode').addEventListener('change', () => setMode($('xmode').value));
    $('colorby').addEventListener('change', () => { D.colorBy = $('colorby').value; setColors(D); tlLegend(); scheduleTimeline(); });
    for (const id of ['range-from', 'range-to']) {
      $(id).addEventListener('keydown', (ev) => { if (ev.key === 'Enter') $('range-apply').click(); });
      $(id).addEventListener('input', () => { tl.rangeEdited = true; });
    }
    window.addEventListener('resize', () => {
      if (activeTab === 'timeline') scheduleTimeline();
      if (activeTab === 'state') drawState();
      if (activeTab === 'segments') drawSegRows();
    });
  }

