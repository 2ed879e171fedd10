// torchmem offline memory viewer. Hand-written, no library, no network: the data sits in this
// page as deflated columns (base64) and is drawn on canvas with level of detail.
(function () {
  'use strict';
  const K = { ALLOC: 0, FREE_REQ: 1, FREE: 2, SEG_ALLOC: 3, SEG_FREE: 4, SEG_MAP: 5, SEG_UNMAP: 6, OOM: 7, SNAP: 8, OTHER: 9 };
  const PALETTE = ['#4e79a7', '#f28e2c', '#e15759', '#76b7b2', '#59a14f', '#edc949', '#af7aa1', '#ff9da7',
    '#9c755f', '#86bcb6', '#d37295', '#8cd17d', '#b6992d', '#499894', '#79706e', '#d4a6c8', '#a0cbe8', '#ffbe7d',
    '#f1ce63', '#bab0ac'];
  const T_START = performance.now();
  const api = {
    ready: false, error: null, firstDrawMs: null, decodeMs: null,
    _tl: { bands: 0, columns: 0, drawMs: 0, draws: 0 }, _map: { segments: 0, blocks: 0 },
  };
  window.__torchmem = api;
  const $ = (id) => document.getElementById(id);
  const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;' }[c]));

  // ---------------------------------------------------------------- formatting (display edge)
  function fmtBytes(n) {
    const a = Math.abs(n), s = n < 0 ? '-' : '';
    const units = [['TiB', 1099511627776], ['GiB', 1073741824], ['MiB', 1048576], ['KiB', 1024]];
    for (const [u, v] of units) if (a >= v) return s + (a / v).toFixed(2) + ' ' + u;
    return s + Math.round(a) + ' B';
  }
  const hex = (a) => '0x' + Math.round(a).toString(16);
  const rgb = (h) => [parseInt(h.slice(1, 3), 16), parseInt(h.slice(3, 5), 16), parseInt(h.slice(5, 7), 16)];
  const PAL_RGB = PALETTE.map(rgb);
  const LE = new Uint8Array(new Uint32Array([1]).buffer)[0] === 1;
  function pack(r, g, b) { return LE ? (0xff000000 | (b << 16) | (g << 8) | r) >>> 0 : ((r << 24) | (g << 16) | (b << 8) | 0xff) >>> 0; }
  const PAL_PX = PAL_RGB.map(([r, g, b]) => pack(r, g, b));
  const PAL_DARK = PAL_RGB.map(([r, g, b]) => pack(r * 0.62 | 0, g * 0.62 | 0, b * 0.62 | 0));
  const PX_WHITE = pack(255, 255, 255), PX_FREE = pack(227, 230, 235), PX_SEGEDGE = pack(90, 100, 118);
  const PX_PEND = pack(200, 60, 40);

  // ---------------------------------------------------------------- payload decoding
  function b64bytes(s) {
    const bin = atob(s.trim());
    const n = bin.length, out = new Uint8Array(n);
    for (let i = 0; i < n; i++) out[i] = bin.charCodeAt(i);
    return out;
  }
  async function inflate(bytes) {
    const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream('deflate'));
    return new Uint8Array(await new Response(stream).arrayBuffer());
  }
  const CTORS = { d: Float64Array, i: Int32Array, B: Uint8Array };
  async function decode() {
    const raw = await inflate(b64bytes($('payload').textContent));
    const dv = new DataView(raw.buffer, raw.byteOffset, raw.byteLength);
    const hlen = dv.getUint32(0, true);
    const head = JSON.parse(new TextDecoder().decode(raw.subarray(4, 4 + hlen)));
    const base = raw.byteOffset + 4 + hlen;
    for (const d of head.devices) {
      const cols = {};
      for (const [name, [code, off, len]] of Object.entries(d.columns)) {
        const C = CTORS[code];
        cols[name] = new C(raw.buffer, base + off, len);
      }
      d.col = cols;
    }
    return head;
  }

  // ---------------------------------------------------------------- shared state
  let P = null;        // payload header + columns
  let D = null;        // current device, with derived arrays
  const tooltip = $('tooltip');
  let activeTab = 'timeline';

  function frameHtml(fid) {
    const f = P.frames[fid];
    const loc = f[1] ? (f[1] + (f[2] ? ':' + f[2] : '')) : '';
    return '<div class="fr"><span class="fn">' + esc(f[0]) + '</span> <span class="loc">' + esc(loc) + '</span></div>';
  }
  const isPy = (f) => /\.py$/.test(f[1]);
  function stackHtml(sid, max) {
    const st = P.stacks[sid] || [];
    if (!st.length) return '<div class="muted">(no stack recorded)</div>';
    // Python frames first (they name the user's code); C++ frames when there are none.
    let ids = st.filter((fid) => isPy(P.frames[fid]));
    let note = '';
    if (!ids.length) ids = st; else if (ids.length < st.length) note = ' (' + (st.length - ids.length) + ' C++ frames hidden)';
    const shown = ids.slice(0, max || 24);
    return '<div class="muted">stack, innermost first' + note + ':</div>' + shown.map(frameHtml).join('') +
      (ids.length > shown.length ? '<div class="muted">&hellip; ' + (ids.length - shown.length) + ' more</div>' : '');
  }
  function timeOf(ev) {
    if (!D.has_time || ev < 0 || ev >= D.n_events) return '';
    return ' (t=' + (D.col.ev_time[ev] / 1e6).toFixed(4) + ' s)';
  }
  function allocHtml(id) {
    const c = D.col;
    const st = c.al_start[id], en = c.al_end[id], rq = c.al_req[id];
    let life = st < 0 ? 'allocated before the trace began' : 'allocated at event #' + st + timeOf(st);
    life += en >= D.n_events ? '; still allocated at the end' : '; freed at event #' + en + timeOf(en);
    if (rq >= 0 && rq !== en) life += ' (free requested at #' + rq + ')';
    return '<div class="h">' + fmtBytes(c.al_size[id]) + ' (' + c.al_size[id] + ' bytes) at ' + hex(c.al_addr[id]) +
      '</div><div>stream ' + esc(D.streams[c.al_stream[id]] || '0') + ' &middot; allocation #' + id + '</div><div>' + life + '</div>' +
      (c.al_meta && c.al_meta[id] >= 0 ? '<div class="muted">' + esc(P.texts[c.al_meta[id]]) + '</div>' : '') + stackHtml(c.al_stack[id]);
  }
  function showTip(html, x, y) {
    tooltip.innerHTML = html;
    tooltip.style.display = 'block';
    const w = tooltip.offsetWidth, h = tooltip.offsetHeight;
    let left = x + 14, top = y + 14;
    if (left + w > window.innerWidth - 4) left = Math.max(4, x - w - 14);
    if (top + h > window.innerHeight - 4) top = Math.max(4, y - h - 14);
    tooltip.style.left = left + 'px';
    tooltip.style.top = top + 'px';
  }
  function hideTip() { tooltip.style.display = 'none'; }

  // ---------------------------------------------------------------- device preparation
  function prepareDevice(d) {
    if (d.prepared) return d;
    const c = d.col, n = d.n_events, nA = d.n_allocs;
    const N = n + 1;  // the state after p events is drawn over [p, p + 1)
    // Positions 0..n: state after the first p events. Allocation id lives on [s, e).
    const s = new Int32Array(nA), e = new Int32Array(nA);
    const delta = new Float64Array(n + 2);
    for (let a = 0; a < nA; a++) {
      s[a] = c.al_start[a] < 0 ? 0 : c.al_start[a] + 1;
      e[a] = c.al_end[a] >= n ? n + 1 : c.al_end[a] + 1;
      delta[s[a]] += c.al_size[a];
      delta[e[a]] -= c.al_size[a];
    }
    const total = new Float64Array(n + 1);
    let run = 0;
    for (let p = 0; p <= n; p++) { run += delta[p]; total[p] = run; }
    // Allocation ids by end position (counting sort) for the sweep.
    const endStart = new Int32Array(n + 3);
    for (let a = 0; a < nA; a++) endStart[e[a] + 1]++;
    for (let p = 1; p < n + 3; p++) endStart[p] += endStart[p - 1];
    const fill = endStart.slice();
    const byEnd = new Int32Array(nA);
    for (let a = 0; a < nA; a++) byEnd[fill[e[a]]++] = a;
    // Stack colours.
    const colorOf = new Uint8Array(nA);
    for (let a = 0; a < nA; a++) colorOf[a] = (c.al_stack[a] * 2654435761 >>> 0) % PALETTE.length;
    // Time axis: running maximum of the event times (streams can interleave slightly).
    let tcum = null, tmin = 0, tmax = 1;
    if (d.has_time && n) {
      tcum = new Float64Array(n);
      let m = -Infinity;
      for (let i = 0; i < n; i++) { m = Math.max(m, c.ev_time[i]); tcum[i] = m; }
      // A margin after the last event so that the final state has some width.
      tmin = tcum[0]; tmax = tcum[n - 1] + Math.max(1, (tcum[n - 1] - tmin) * 0.01);
    }
    Object.assign(d, { prepared: true, N, s, e, total, endStart, byEnd, colorOf, tcum, tmin, tmax,
      alive: new Uint8Array(nA), live: new Int32Array(Math.max(nA, 1)), seen: new Uint32Array(nA), frame: 0 });
    return d;
  }

  // ---------------------------------------------------------------- timeline
  const tl = { canvas: $('timeline'), x0: 0, x1: 1, ml: 78, mr: 12, mt: 10, mb: 30, pick: null, W: 0, H: 0,
    ymax: 1, colEvent: null, pending: false };
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
    const ms = performance.now() - t0;
    api._tl = { bands, columns: W, drawMs: ms, draws: api._tl.draws + 1, ymax };
    if (api.firstDrawMs === null) api.firstDrawMs = performance.now() - T_START + (performance.timeOrigin ? 0 : 0);
    const from = Math.max(0, Math.floor(toPos(x0))), to = Math.min(n, Math.ceil(toPos(x1)));
    if (timeMode) { $('range-from').value = (x0 / 1e6).toFixed(6); $('range-to').value = (x1 / 1e6).toFixed(6); }
    else { $('range-from').value = from; $('range-to').value = to; }
    let peak = 0, peakAt = 0;
    for (let p = from; p <= to; p++) if (d.total[p] > peak) { peak = d.total[p]; peakAt = p; }
    $('timeline-summary').innerHTML = 'events ' + from + '&ndash;' + to + ' of ' + n + ' &middot; ' + d.n_allocs + ' allocations (' + d.n_pre +
      ' from before the trace) &middot; peak in view <b>' + fmtBytes(peak) + '</b> after event #' + Math.max(0, peakAt - 1) +
      ' &middot; ' + bands + ' allocations drawn &middot; drawn in ' + ms.toFixed(0) + ' ms' +
      (d.has_time && n ? ' &middot; time ' + (d.col.ev_time[Math.min(from, n - 1)] / 1e6).toFixed(4) + ' s &ndash; ' + (d.col.ev_time[Math.max(0, Math.min(to, n) - 1)] / 1e6).toFixed(4) + ' s' : '');
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
    const span = tl.x1 - tl.x0, timeMode = tl.mode === 'time';
    const xs = timeMode ? niceStep(span, 8) : Math.max(1, niceStep(span, 8));
    const digits = timeMode ? Math.max(0, Math.min(6, -Math.floor(Math.log10(xs / 1e6) + 1e-9))) : 0;
    for (let v = Math.ceil(tl.x0 / xs) * xs; v <= tl.x1; v += xs) {
      const x = ml + (v - tl.x0) / span * W;
      ctx.textAlign = x > ml + W - 30 ? 'right' : 'center';
      ctx.fillText(timeMode ? (v / 1e6).toFixed(digits) : String(Math.round(v)), x, mt + H + 6);
      ctx.beginPath(); ctx.moveTo(x + 0.5, mt + H); ctx.lineTo(x + 0.5, mt + H + 4); ctx.stroke();
    }
    ctx.textAlign = 'right';
    ctx.fillText(timeMode ? 'time (s)' : 'event #', ml + W, mt + H + 18);
    const pk = D.stats && D.stats.peak_index;
    if (pk !== undefined && pk !== null && D.n_events) {  // the peak found by the analysis
      const x = ml + ((timeMode ? D.tcum[Math.max(0, pk - 1)] : pk) - tl.x0) / span * W;
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
        selectStateEvent(Math.max(0, Math.min(D.n_events, tl.mode === 'time' ? posOfTime(v) : Math.floor(v))));
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
    cv.addEventListener('dblclick', reset);
    $('range-apply').addEventListener('click', () => {
      // Times are whole microseconds: round so that "1.250000 s" includes an event at 1250000 us.
      const conv = (v) => tl.mode === 'time' ? Math.round(+v * 1e6) : +v;
      setView(conv($('range-from').value), conv($('range-to').value));
    });
    $('range-reset').addEventListener('click', reset);
    $('xmode').addEventListener('change', () => setMode($('xmode').value));
    for (const id of ['range-from', 'range-to']) $(id).addEventListener('keydown', (ev) => { if (ev.key === 'Enter') $('range-apply').click(); });
    window.addEventListener('resize', () => { if (activeTab === 'timeline') scheduleTimeline(); if (activeTab === 'state') drawState(); });
  }

  // ---------------------------------------------------------------- allocator state history
  // The state after p events: segments (addr -> [size, stream]) and live blocks
  // (addr -> {id, size, state, stack}); free space is what a segment has outside its blocks.
  const st = { pos: -1, segs: null, blocks: null, sel: 0, canvas: $('statemap'), pick: null, cellInfo: null };
  function stateReset() {
    const c = D.col;
    st.segs = new Map(); st.blocks = new Map();
    for (let i = 0; i < D.n_segments; i++) st.segs.set(c.seg_addr[i], [c.seg_size[i], c.seg_stream[i]]);
    for (let b = 0; b < D.n_blocks; b++) {
      if (!c.blk_state[b]) continue;
      const id = c.blk_alloc[b];
      st.blocks.set(c.blk_addr[b], { id, size: c.blk_size[b], state: c.blk_state[b], stack: id >= 0 ? c.al_stack[id] : c.blk_stack[b] });
    }
    st.pos = D.n_events;
  }
  function applyEvent(i, forward) {
    const c = D.col, k = c.ev_kind[i], r = c.ev_ref[i];
    if (k <= K.FREE) {
      if (r < 0) return;
      const addr = c.al_addr[r];
      const blk = { id: r, size: Math.max(512, Math.ceil(c.al_size[r] / 512) * 512), state: 1, stack: c.al_stack[r] };
      if (k === K.ALLOC) { if (forward) st.blocks.set(addr, blk); else st.blocks.delete(addr); }
      else if (k === K.FREE_REQ) { const b = st.blocks.get(addr); if (b) b.state = forward ? 2 : 1; }
      else if (forward) st.blocks.delete(addr);
      else { blk.state = (c.al_req[r] >= 0 && c.al_req[r] < i) ? 2 : 1; st.blocks.set(addr, blk); }
    } else if (k >= K.SEG_ALLOC && k <= K.SEG_UNMAP) {
      const add = (k === K.SEG_ALLOC || k === K.SEG_MAP) === forward;
      const a = c.se_addr[r], sz = c.se_size[r];
      if (k === K.SEG_ALLOC || k === K.SEG_FREE) {
        if (add) st.segs.set(a, [sz, c.se_stream[r]]); else st.segs.delete(a);
        return;
      }
      // Expandable segments grow and shrink by mapping pages at their end.
      if (add) {
        for (const [sa, v] of st.segs) if (sa + v[0] === a) { v[0] += sz; return; }
        st.segs.set(a, [sz, c.se_stream[r]]);
      } else {
        if (st.segs.has(a)) { st.segs.delete(a); return; }
        for (const [sa, v] of st.segs) if (sa < a && a + sz === sa + v[0]) { v[0] -= sz; return; }
      }
    }
  }
  function stateMoveTo(p) {
    if (st.pos < 0) stateReset();
    if (Math.abs(p - st.pos) > p + 1 && p < st.pos) { /* backwards is the only way from the end */ }
    while (st.pos > p) { st.pos--; applyEvent(st.pos, false); }
    while (st.pos < p) { applyEvent(st.pos, true); st.pos++; }
  }
  function eventLabel(i) {
    const c = D.col, k = c.ev_kind[i], r = c.ev_ref[i];
    const name = P.kind_names[k] || 'other';
    if (k <= K.FREE && r >= 0) {
      const sid = c.al_stack[r], fr = (P.stacks[sid] || []).map((f) => P.frames[f]);
      const top = fr.find(isPy) || fr[0];
      return name + ' ' + fmtBytes(c.al_size[r]) + ' ' + hex(c.al_addr[r]) + (top ? ' ' + top[0] : '');
    }
    if (k >= K.SEG_ALLOC && k <= K.SEG_UNMAP) return name + ' ' + fmtBytes(c.se_size[r]) + ' ' + hex(c.se_addr[r]);
    if (k === K.OOM) { const o = D.ooms[r]; return 'oom: requested ' + fmtBytes(o.size) + ', device free ' + fmtBytes(o.device_free); }
    return name;
  }
  function renderEventList() {
    const box = $('ev-list'), n = D.n_events, sel = st.sel;
    if (!n) { box.innerHTML = '<div class="muted">This snapshot has no trace events: the state shown is the end state.</div>'; return; }
    const a = Math.max(0, sel - 60), b = Math.min(n, sel + 60);
    let html = '';
    for (let i = a; i < b; i++) html += '<div data-i="' + i + '"' + (i === sel - 1 ? ' class="sel"' : '') + '>#' + i + ' ' + esc(eventLabel(i)) + '</div>';
    box.innerHTML = html;
    const s = box.querySelector('.sel');
    if (s) box.scrollTop = s.offsetTop - box.clientHeight / 2;
  }
  function selectStateEvent(p) {
    st.sel = p;
    const n = D.n_events;
    $('ev-slider').value = p; $('ev-num').value = p;
    $('ev-desc').textContent = n ? (p === 0 ? 'before the first event' : 'after #' + (p - 1) + ': ' + eventLabel(p - 1) + timeOf(p - 1)) : 'end state';
    if (activeTab === 'state') { renderEventList(); drawState(); }
  }
  function drawState() {
    const t0 = performance.now();
    stateMoveTo(st.sel);
    const cv = st.canvas;
    const w = Math.max(300, cv.parentElement.clientWidth);
    if (cv.width !== w) cv.width = w;
    const W = cv.width, H = cv.height, rowH = 12, gapH = 4, rows = Math.floor(H / (rowH + gapH));
    const segs = [...st.segs.entries()].sort((p, q) => p[0] - q[0]);
    const blocks = [...st.blocks.entries()].sort((p, q) => p[0] - q[0]);
    let reserved = 0;
    for (const [, v] of segs) reserved += v[0];
    const cells = W * rows;
    let gap = 2;
    if (cells - gap * segs.length < cells / 2) gap = 1;
    if (cells - gap * segs.length < cells / 2) gap = 0;
    const bpc = Math.max(1, reserved / Math.max(1, cells - gap * segs.length - 1));
    const ctx = cv.getContext('2d');
    const img = ctx.createImageData(W, H), px = new Uint32Array(img.data.buffer);
    px.fill(PX_WHITE);
    const pick = new Int32Array(cells).fill(-1);
    const info = [];   // pick value -> [kind, ...]
    const put = (cell, color, hatch) => {
      if (cell >= cells) return;
      const r = Math.floor(cell / W), x = cell % W, y0 = r * (rowH + gapH);
      for (let y = 0; y < rowH; y++) px[(y0 + y) * W + x] = (hatch && (x + y) % 4 < 2) ? PX_WHITE : color;
    };
    let cell = 0, bi = 0, allocated = 0, active = 0, nblocks = 0;
    for (let si = 0; si < segs.length; si++) {
      const [sa, [ss, sstream]] = segs[si];
      const ncell = Math.max(1, Math.round(ss / bpc));
      const segInfo = info.length;
      info.push(['seg', sa, ss, sstream, 0]);
      for (let k = 0; k < ncell; k++) { put(cell + k, PX_FREE); if (cell + k < cells) pick[cell + k] = segInfo; }
      put(cell, PX_SEGEDGE);
      while (bi < blocks.length && blocks[bi][0] < sa) bi++;
      let used = 0;
      for (; bi < blocks.length && blocks[bi][0] < sa + ss; bi++) {
        const [ba, b] = blocks[bi];
        nblocks++; used += b.size; active += b.size; if (b.state === 1) allocated += b.size;
        const c0 = cell + Math.floor((ba - sa) / bpc), c1 = Math.max(c0 + 1, cell + Math.min(ncell, Math.ceil((ba - sa + b.size) / bpc)));
        const bInfo = info.length;
        info.push(['blk', ba, b]);
        const ci = (b.stack * 2654435761 >>> 0) % PALETTE.length;
        const pend = b.state !== 1;
        for (let k = c0; k < c1; k++) { put(k, pend ? PX_PEND : PAL_PX[ci], pend); if (k < cells) pick[k] = bInfo; }
        if (c1 - c0 >= 4) put(c1 - 1, pend ? PX_PEND : PAL_DARK[ci], pend);
      }
      info[segInfo][4] = used;
      cell += ncell + gap;
    }
    ctx.putImageData(img, 0, 0);
    st.pick = pick; st.info = info; st.W = W; st.rowH = rowH; st.gapH = gapH; st.cells = cells;
    api._map = { segments: segs.length, blocks: nblocks, reserved, allocated, active, ms: performance.now() - t0 };
    $('state-summary').innerHTML = segs.length + ' segments, ' + fmtBytes(reserved) + ' reserved &middot; ' + nblocks + ' live blocks, ' +
      fmtBytes(allocated) + ' allocated, ' + fmtBytes(active - allocated) + ' pending free &middot; one pixel column = ' + fmtBytes(bpc) +
      ' &middot; replayed in ' + (performance.now() - t0).toFixed(0) + ' ms';
  }
  function statePickAt(clientX, clientY) {
    const cv = st.canvas, r = cv.getBoundingClientRect();
    const x = Math.floor((clientX - r.left) * (cv.width / r.width)), y = Math.floor((clientY - r.top) * (cv.height / r.height));
    const row = Math.floor(y / (st.rowH + st.gapH));
    if (y - row * (st.rowH + st.gapH) >= st.rowH || x < 0 || x >= st.W) return null;
    const c = row * st.W + x;
    if (c >= st.cells || st.pick[c] < 0) return null;
    return st.info[st.pick[c]];
  }
  function setupState() {
    const sl = $('ev-slider');
    sl.addEventListener('input', () => selectStateEvent(+sl.value));
    $('ev-num').addEventListener('change', () => selectStateEvent(Math.max(0, Math.min(D.n_events, +$('ev-num').value))));
    $('ev-prev').addEventListener('click', () => selectStateEvent(Math.max(0, st.sel - 1)));
    $('ev-next').addEventListener('click', () => selectStateEvent(Math.min(D.n_events, st.sel + 1)));
    $('ev-list').addEventListener('click', (ev) => { const t = ev.target.closest('[data-i]'); if (t) selectStateEvent(+t.dataset.i + 1); });
    st.canvas.addEventListener('mousemove', (ev) => {
      const it = st.pick && statePickAt(ev.clientX, ev.clientY);
      if (!it) { hideTip(); return; }
      if (it[0] === 'seg') {
        showTip('<div class="h">segment ' + hex(it[1]) + ', ' + fmtBytes(it[2]) + '</div><div>stream ' + esc(D.streams[it[3]] || '0') +
          ' &middot; ' + fmtBytes(it[4]) + ' in live blocks, ' + fmtBytes(it[2] - it[4]) + ' free</div>', ev.clientX, ev.clientY);
      } else {
        const b = it[2];
        const head = '<div class="h">' + (b.state === 1 ? 'allocated' : 'freed, pending (active_pending_free)') + ' block ' + hex(it[1]) + ', ' + fmtBytes(b.size) + '</div>';
        showTip(head + (b.id >= 0 ? allocHtml(b.id) : stackHtml(b.stack)), ev.clientX, ev.clientY);
      }
    });
    st.canvas.addEventListener('mouseleave', hideTip);
    document.addEventListener('keydown', (ev) => {
      if (activeTab !== 'state' || ev.target.tagName === 'INPUT') return;
      if (ev.key === 'ArrowLeft') selectStateEvent(Math.max(0, st.sel - 1));
      else if (ev.key === 'ArrowRight') selectStateEvent(Math.min(D.n_events, st.sel + 1));
    });
  }

  // ---------------------------------------------------------------- segments table (end state)
  function renderSegments() {
    const c = D.col, body = $('seg-body');
    const rows = [], LIMIT = 2000;
    for (let i = 0; i < Math.min(D.n_segments, LIMIT); i++) {
      const a = c.seg_addr[i], sz = c.seg_size[i], first = c.seg_first[i], last = i + 1 < D.n_segments ? c.seg_first[i + 1] : D.n_blocks;
      let alloc = 0, spans = '';
      for (let b = first; b < last; b++) {
        const bs = c.blk_size[b], state = c.blk_state[b];
        if (state === 1) alloc += bs;
        if (!state) continue;
        const left = (c.blk_addr[b] - a) / sz * 100, width = Math.max(0.15, bs / sz * 100);
        const sid = c.blk_alloc[b] >= 0 ? c.al_stack[c.blk_alloc[b]] : c.blk_stack[b];
        const color = state === 2 ? '#c83c28' : PALETTE[(sid * 2654435761 >>> 0) % PALETTE.length];
        spans += '<span data-b="' + b + '" style="left:' + left.toFixed(3) + '%;width:' + width.toFixed(3) + '%;background:' + color + '"></span>';
      }
      rows.push('<tr><td>' + i + '</td><td>' + hex(a) + '</td><td>' + fmtBytes(sz) + '</td><td>' + fmtBytes(alloc) + '</td><td>' + (last - first) +
        '</td><td>' + esc(D.streams[c.seg_stream[i]] || '0') + '</td><td>' + (c.seg_pool[i] ? 'small' : 'large') + '</td><td class="l"><div class="bar">' + spans + '</div></td></tr>');
    }
    body.innerHTML = rows.join('') || '<tr><td colspan="8" class="l muted">no segments in this snapshot</td></tr>';
    const s = D.stats || {};
    $('seg-summary').innerHTML = D.n_segments + ' segments, ' + D.n_blocks + ' blocks at the end state' + (D.n_segments > LIMIT ? ' (first ' + LIMIT + ' listed)' : '') +
      (s.reserved_bytes !== undefined ? ' &middot; ' + fmtBytes(s.reserved_bytes) + ' reserved, ' + fmtBytes(s.allocated_bytes) + ' allocated' : '');
  }
  function setupSegments() {
    $('seg-body').addEventListener('mousemove', (ev) => {
      const t = ev.target.closest('[data-b]');
      if (!t) { hideTip(); return; }
      const b = +t.dataset.b, c = D.col, id = c.blk_alloc[b];
      const head = '<div class="h">' + (c.blk_state[b] === 1 ? 'allocated' : 'pending free') + ' block ' + hex(c.blk_addr[b]) + ', ' + fmtBytes(c.blk_size[b]) + '</div>';
      showTip(head + (id >= 0 ? allocHtml(id) : stackHtml(c.blk_stack[b])), ev.clientX, ev.clientY);
    });
    $('seg-body').addEventListener('mouseleave', hideTip);
  }

  // ---------------------------------------------------------------- stats
  function renderStats() {
    const s = D.stats || {};
    const byteKeys = new Set(['reserved_bytes', 'allocated_bytes', 'active_bytes', 'requested_bytes', 'free_bytes', 'largest_free_block', 'rounding_slack_bytes', 'peak_allocated_bytes']);
    let html = '<h3>Device ' + esc(D.device) + '</h3><table id="stats-table">';
    for (const [k, v] of Object.entries(s)) {
      if (v !== null && typeof v === 'object') continue;
      html += '<tr><th class="l">' + esc(k) + '</th><td data-key="' + esc(k) + '" data-value="' + esc(v) + '">' +
        (byteKeys.has(k) || /_bytes$/.test(k) ? fmtBytes(v) + ' <span class="muted">(' + v + ')</span>' : esc(v)) + '</td></tr>';
    }
    html += '</table>';
    for (const [k, v] of Object.entries(s)) {
      if (v === null || typeof v !== 'object' || Array.isArray(v)) continue;
      html += '<h3>' + esc(k) + '</h3><table>';
      for (const [name, row] of Object.entries(v)) {
        html += '<tr><th class="l">' + esc(name) + '</th>';
        if (row && typeof row === 'object') for (const [rk, rv] of Object.entries(row)) html += '<td>' + esc(rk) + ': ' + (/bytes/.test(rk) ? fmtBytes(rv) : esc(rv)) + '</td>';
        else html += '<td>' + esc(row) + '</td>';
        html += '</tr>';
      }
      html += '</table>';
    }
    if (s.at_peak && s.at_peak.length) {
      html += '<h3>Live at the peak (' + fmtBytes(s.peak_allocated_bytes) + ' after event #' + Math.max(0, s.peak_index - 1) + '), by stack</h3>' +
        '<table><tr><th>bytes</th><th>allocations</th><th class="l">stack (innermost first, PyTorch internals hidden)</th></tr>';
      for (const g of s.at_peak) html += '<tr><td>' + fmtBytes(g.bytes) + '</td><td>' + g.count + '</td><td class="l">' + g.stack.map(esc).join('<br>') + '</td></tr>';
      html += '</table>';
    }
    if (D.ooms.length) {
      const verdicts = new Map((s.oom_reports || []).map((o) => [o.index, o]));
      html += '<h3>Out-of-memory events</h3><table><tr><th>event</th><th>requested</th><th>device free</th><th class="l">verdict</th><th class="l">stack</th></tr>';
      for (const o of D.ooms) {
        const v = verdicts.get(o.event);
        html += '<tr><td>#' + o.event + '</td><td>' + fmtBytes(o.size) + '</td><td>' + fmtBytes(o.device_free) + '</td><td class="l">' +
          (v ? '<b>' + esc(v.verdict) + '</b><br>' + esc(v.explanation) : '') + '</td><td class="l">' + stackHtml(o.stack, 6) + '</td></tr>';
      }
      html += '</table>';
    }
    if (P.allocator_settings) {
      html += '<h3>Allocator settings</h3><table>';
      for (const [k, v] of Object.entries(P.allocator_settings)) html += '<tr><th class="l">' + esc(k) + '</th><td class="l">' + esc(typeof v === 'object' ? JSON.stringify(v) : v) + '</td></tr>';
      html += '</table>';
    }
    if (P.notes && P.notes.length) html += '<h3>Notes</h3>' + P.notes.map((t) => '<p>' + esc(t) + '</p>').join('');
    html += '<p class="muted">Trace: ' + D.n_events + ' events, ' + D.n_allocs + ' allocations' + (D.has_time ? '' : ', no timestamps') + '.</p>';
    $('stats').innerHTML = html;
  }

  // ---------------------------------------------------------------- wiring
  function showTab(name) {
    activeTab = name;
    for (const b of document.querySelectorAll('#tabs button')) b.classList.toggle('on', b.dataset.tab === name);
    for (const s of document.querySelectorAll('.tab')) s.classList.toggle('on', s.id === 'tab-' + name);
    hideTip();
    if (name === 'timeline') scheduleTimeline();
    if (name === 'state') { renderEventList(); drawState(); }
    if (name === 'segments' && !D.segRendered) { renderSegments(); D.segRendered = true; }
    if (name === 'stats') renderStats();
  }
  function selectDevice(i) {
    D = prepareDevice(P.devices[i]);
    st.pos = -1;
    tl.mode = 'event'; modeLabels();
    tl.x0 = 0; tl.x1 = D.N;
    $('xmode-wrap').style.display = D.tcum ? '' : 'none';
    $('ev-slider').max = D.n_events;
    selectStateEvent(D.n_events);
    showTab(activeTab);
  }
  api.stats = () => Object.assign({ device: D ? D.device : null, events: D ? D.n_events : 0, allocs: D ? D.n_allocs : 0 }, api._tl);
  api.mapStats = () => api._map;
  api.pickAt = (x, y) => tlPickAt(x, y);
  api.showTab = showTab;
  api.selectEvent = (p) => selectStateEvent(p);
  api.setView = (a, b) => { tl.x0 = a; tl.x1 = b; drawTimeline(); return api.stats(); };
  api.setMode = (m) => { setMode(m); drawTimeline(); return { mode: tl.mode, x0: tl.x0, x1: tl.x1 }; };
  // A point (client coordinates) over a drawn band whose allocation has a stack, for tests.
  api.findBand = (wantStack = true) => {
    const r = tl.canvas.getBoundingClientRect(), sx = r.width / tl.canvas.width, sy = r.height / tl.canvas.height;
    const W = tl.W, H = tl.H, pk = tl.pick, count = new Map(), where = new Map();
    // The band with the most interior pixels (its neighbours 2 px around belong to it too), so a
    // mouse at rounded coordinates still lands on it.
    for (let i = 0; i < pk.length; i++) {
      const a = pk[i];
      if (a < 0 || (wantStack && !(P.stacks[D.col.al_stack[a]] || []).length)) continue;
      const x = i % W, y = Math.floor(i / W);
      const inner = x >= 2 && y >= 2 && x < W - 2 && y < H - 2 && pk[i - 2] === a && pk[i + 2] === a && pk[i - 2 * W] === a && pk[i + 2 * W] === a;
      const c = (count.get(a) || 0) + (inner ? 1000 : 1);
      count.set(a, c);
      if (inner || !where.has(a)) where.set(a, i);
    }
    let best = -1, bc = 0;
    for (const [a, c] of count) if (c > bc) { bc = c; best = a; }
    if (best < 0) return null;
    const i = where.get(best), x = i % W, y = Math.floor(i / W);
    // Mouse events carry whole CSS pixels: return the first whole coordinate inside the pixel.
    const cx = Math.ceil(r.left + (x + tl.ml) * sx + 1e-6), cy = Math.ceil(r.top + (y + tl.mt) * sy + 1e-6);
    return { id: best, x: cx + 0.25, y: cy + 0.25, addr: D.col.al_addr[best], size: D.col.al_size[best] };
  };
  api.allocInfo = (id) => ({ addr: D.col.al_addr[id], size: D.col.al_size[id], start: D.col.al_start[id], end: D.col.al_end[id], stack: (P.stacks[D.col.al_stack[id]] || []).map((f) => P.frames[f]) });

  async function main() {
    try {
      P = await decode();
      api.decodeMs = performance.now() - T_START;
      const sel = $('device');
      P.devices.forEach((d, i) => { const o = document.createElement('option'); o.value = i; o.textContent = d.name + ' (' + d.n_events + ' events)'; sel.appendChild(o); });
      sel.addEventListener('change', () => selectDevice(+sel.value));
      for (const b of document.querySelectorAll('#tabs button')) b.addEventListener('click', () => showTab(b.dataset.tab));
      setupTimeline(); setupState(); setupSegments();
      $('loading').style.display = 'none';
      if (!P.devices.length) {
        $('loading').style.display = 'block';
        $('loading').textContent = 'This snapshot is empty: no segments and no trace events.';
        api.ready = true;
        document.documentElement.dataset.tmReady = '1';
        return;
      }
      selectDevice(0);
      drawTimeline();
      api.ready = true;
      document.documentElement.dataset.tmReady = '1';  // for tests: no eval needed to wait
    } catch (err) {
      api.error = String(err && err.stack || err);
      document.documentElement.dataset.tmError = '1';
      const l = $('loading'); l.classList.add('err'); l.textContent = 'Could not open this report: ' + err;
      throw err;
    }
  }
  main();
})();
