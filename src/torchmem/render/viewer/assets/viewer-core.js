// torchmem offline memory viewer. Hand-written, no library, no network: the data sits in this
// page as deflated columns (base64) and is drawn on canvas with level of detail.
(function () {
  'use strict';
  const K = { ALLOC: 0, FREE_REQ: 1, FREE: 2, SEG_ALLOC: 3, SEG_FREE: 4, SEG_MAP: 5, SEG_UNMAP: 6, OOM: 7, SNAP: 8, OTHER: 9 };
  const PALETTE = ['#4e79a7', '#f28e2c', '#e15759', '#76b7b2', '#59a14f', '#edc949', '#af7aa1', '#ff9da7',
    '#9c755f', '#86bcb6', '#d37295', '#8cd17d', '#b6992d', '#499894', '#79706e', '#d4a6c8', '#a0cbe8', '#ffbe7d',
    '#f1ce63', '#bab0ac'];
  // Colours of torchmem's allocation categories (payload category_names order: other, parameter,
  // buffer, gradient, activation, optimizer_state, input, temporary, communication), then "not known".
  const CAT_COLORS = ['#9aa3b2', '#4e79a7', '#76b7b2', '#f28e2c', '#59a14f', '#af7aa1', '#edc949', '#e15759', '#d37295', '#d4d8de'];
  const CAT0 = PALETTE.length;
  PALETTE.push(...CAT_COLORS);
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
  const CTORS = { d: Float64Array, i: Int32Array, B: Uint8Array, b: Int8Array };
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
      originHtml(id) + (c.al_meta && c.al_meta[id] >= 0 ? '<div class="muted">' + esc(P.texts[c.al_meta[id]]) + '</div>' : '') + stackHtml(c.al_stack[id]);
  }
  // Category, phase and module of an allocation of a torchmem trace ('' for PyTorch snapshots).
  function originHtml(id) {
    const c = D.col;
    if (!D.hasOrigin) return '';
    const cat = c.al_cat[id], ph = c.al_phase[id], mod = c.al_module[id];
    const parts = [];
    if (cat >= 0) parts.push('category <b class="cat">' + esc(P.category_names[cat]) + '</b>');
    if (ph >= 0) parts.push('phase <b class="phase">' + esc(P.phase_names[ph]) + '</b>');
    if (mod >= 0) parts.push('module <b class="module">' + esc(P.texts[mod]) + '</b>');
    return parts.length ? '<div class="origin">' + parts.join(' &middot; ') + '</div>' : '';
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
    const hasOrigin = !!(c.al_cat && c.al_cat.length === nA && nA);
    const colorOf = new Uint8Array(nA);
    // Time axis: running maximum of the event times (streams can interleave slightly).
    let tcum = null, tmin = 0, tmax = 1;
    if (d.has_time && n) {
      tcum = new Float64Array(n);
      let m = -Infinity;
      for (let i = 0; i < n; i++) { m = Math.max(m, c.ev_time[i]); tcum[i] = m; }
      // A margin after the last event so that the final state has some width.
      // Times count from the start of the run (ev_time is relative to the first entry): the axis
      // starts at 0 even when the first entry's time is not the smallest.
      tmin = 0; tmax = tcum[n - 1] + Math.max(1, tcum[n - 1] * 0.01);
      // The ranks of a job share one time axis: it ends with the job's last event.
      if (d.t_end_us) tmax = Math.max(tmax, d.t_end_us + Math.max(1, d.t_end_us * 0.01));
    }
    Object.assign(d, { prepared: true, N, s, e, total, endStart, byEnd, colorOf, tcum, tmin, tmax, hasOrigin,
      colorBy: hasOrigin ? 'category' : 'stack',
      alive: new Uint8Array(nA), live: new Int32Array(Math.max(nA, 1)), seen: new Uint32Array(nA), frame: 0 });
    setColors(d);
    return d;
  }
  // Band colours: by allocating stack, or by category for torchmem's own traces.
  function setColors(d) {
    const c = d.col, colorOf = d.colorOf, byCat = d.colorBy === 'category';
    for (let a = 0; a < d.n_allocs; a++) {
      colorOf[a] = byCat ? CAT0 + (c.al_cat[a] >= 0 ? c.al_cat[a] : CAT_COLORS.length - 1)
        : (c.al_stack[a] * 2654435761 >>> 0) % CAT0;
    }
  }
