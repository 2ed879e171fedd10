  // ---------------------------------------------------------------- allocator state history
  // The state after p events: segments (addr -> [size, stream]) and live blocks
  // (addr -> {id, size, state, stack}); free space is what a segment has outside its blocks
  // (the allocator merges free neighbours, so each gap is one free block). Block sizes come from
  // the allocator simulator's replay of the trace (al_bsize: slack included, exact); without it
  // (the simulator could not reproduce the trace) a request is rounded up to 512 B.
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
      const size = c.al_bsize && c.al_bsize.length ? c.al_bsize[r] : Math.max(512, Math.ceil(c.al_size[r] / 512) * 512);
      const blk = { id: r, size, state: 1, stack: c.al_stack[r] };
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
  // The state after p events as plain data, for tests: segments [addr, size] and, per segment,
  // its blocks in address order [offset, size, state] with the free gaps as state 0.
  api.stateLayout = (p) => {
    stateMoveTo(p);
    const segs = [...st.segs.entries()].sort((x, y) => x[0] - y[0]);
    const blocks = [...st.blocks.entries()].sort((x, y) => x[0] - y[0]);
    let bi = 0;
    return segs.map(([sa, [ss]]) => {
      const out = [];
      let pos = 0;
      while (bi < blocks.length && blocks[bi][0] < sa) bi++;
      for (; bi < blocks.length && blocks[bi][0] < sa + ss; bi++) {
        const [ba, b] = blocks[bi];
        if (ba - sa > pos) out.push([pos, ba - sa - pos, 0]);
        out.push([ba - sa, b.size, b.state]);
        pos = ba - sa + b.size;
      }
      if (pos < ss) out.push([pos, ss - pos, 0]);
      return [sa, ss, out];
    });
  };
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
        const ci = (b.stack * 2654435761 >>> 0) % CAT0;
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
      ' &middot; replayed in ' + (performance.now() - t0).toFixed(0) + ' ms' + stateModelNote();
  }
  // Whether block sizes are the allocator simulator's (exact) or requests rounded to 512 B.
  function stateModelNote() {
    const m = (D.stats || {}).allocator_state;
    if (!m) return '';
    const how = m.startsWith('simulated') ? 'exact (allocator simulator)' : m.startsWith('exact') ? 'exact (one storage per segment)' : 'approximate (requests rounded to 512 B)';
    return ' &middot; <span title="' + esc(m) + '">block sizes: ' + how + '</span>';
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
  // Sorted, filtered and virtualised: only the rows in (and near) the scrolled view are in the
  // page, so a file with thousands of segments keeps a short page and a fast tab.
  const seg = { key: 'index', dir: 1, rowH: 22, pending: false, measured: false };
  const SEG_KEYS = {
    index: (i) => i, addr: (i) => D.col.seg_addr[i], size: (i) => D.col.seg_size[i], alloc: (i) => segInfo().alloc[i],
    free: (i) => D.col.seg_size[i] - segInfo().active[i], blocks: (i) => segInfo().nb[i],
    stream: (i) => D.col.seg_stream[i], pool: (i) => D.col.seg_pool[i],
  };
  function segInfo() {  // per segment: allocated and active bytes, block count (computed once)
    if (D.segInfo) return D.segInfo;
    const c = D.col, n = D.n_segments;
    const alloc = new Float64Array(n), active = new Float64Array(n), nb = new Int32Array(n);
    for (let i = 0; i < n; i++) {
      const first = c.seg_first[i], last = i + 1 < n ? c.seg_first[i + 1] : D.n_blocks;
      nb[i] = last - first;
      for (let b = first; b < last; b++) {
        if (c.blk_state[b] === 1) alloc[i] += c.blk_size[b];
        if (c.blk_state[b]) active[i] += c.blk_size[b];
      }
    }
    D.segInfo = { alloc, active, nb, text: null };
    return D.segInfo;
  }
  function segText(i) {  // what the filter searches: address, stream, pool, frames of its blocks
    const info = segInfo();
    if (!info.text) info.text = new Array(D.n_segments);
    if (info.text[i] === undefined) {
      const c = D.col, first = c.seg_first[i], last = i + 1 < D.n_segments ? c.seg_first[i + 1] : D.n_blocks;
      const parts = [hex(c.seg_addr[i]), 'stream=' + (D.streams[c.seg_stream[i]] || '0'), c.seg_pool[i] ? 'small' : 'large'];
      const sids = new Set();
      for (let b = first; b < last; b++) { if (c.blk_state[b]) sids.add(c.blk_alloc[b] >= 0 ? c.al_stack[c.blk_alloc[b]] : c.blk_stack[b]); }
      for (const sid of sids) for (const fid of P.stacks[sid] || []) parts.push(P.frames[fid][0], P.frames[fid][1]);
      info.text[i] = parts.join(' ').toLowerCase();
    }
    return info.text[i];
  }
  function segRows() {
    const terms = $('seg-filter').value.toLowerCase().split(/\s+/).filter(Boolean), pool = $('seg-pool').value;
    const rows = [];
    for (let i = 0; i < D.n_segments; i++) {
      if (pool && (D.col.seg_pool[i] ? 'small' : 'large') !== pool) continue;
      if (terms.length) { const t = segText(i); if (!terms.every((w) => t.includes(w))) continue; }
      rows.push(i);
    }
    const f = SEG_KEYS[seg.key], dir = seg.dir;
    if (seg.key !== 'index' || dir < 0) rows.sort((a, b) => (f(a) - f(b)) * dir || a - b);
    return rows;
  }
  function segRowHtml(i) {
    const c = D.col, a = c.seg_addr[i], sz = c.seg_size[i], first = c.seg_first[i], last = i + 1 < D.n_segments ? c.seg_first[i + 1] : D.n_blocks;
    const info = segInfo();
    let spans = '';
    for (let b = first; b < last; b++) {
      const bs = c.blk_size[b], state = c.blk_state[b];
      if (!state) continue;
      const left = (c.blk_addr[b] - a) / sz * 100, width = Math.max(0.15, bs / sz * 100);
      const sid = c.blk_alloc[b] >= 0 ? c.al_stack[c.blk_alloc[b]] : c.blk_stack[b];
      const color = state === 2 ? '#c83c28' : PALETTE[(sid * 2654435761 >>> 0) % CAT0];
      spans += '<span data-b="' + b + '" style="left:' + left.toFixed(3) + '%;width:' + width.toFixed(3) + '%;background:' + color + '"></span>';
    }
    return '<tr class="seg" data-i="' + i + '"><td>' + i + '</td><td>' + hex(a) + '</td><td data-v="' + sz + '">' + fmtBytes(sz) + '</td><td data-v="' + info.alloc[i] + '">' +
      fmtBytes(info.alloc[i]) + '</td><td data-v="' + (sz - info.active[i]) + '">' + fmtBytes(sz - info.active[i]) + '</td><td>' + info.nb[i] +
      '</td><td>' + esc(D.streams[c.seg_stream[i]] || '0') + '</td><td>' + (c.seg_pool[i] ? 'small' : 'large') + '</td><td class="l"><div class="bar">' + spans + '</div></td></tr>';
  }
  function drawSegRows() {
    seg.pending = false;
    const box = $('seg-scroll'), body = $('seg-body'), rows = D.segView || [], n = rows.length;
    if (!D.n_segments) { body.innerHTML = '<tr><td colspan="9" class="l muted">no segments in this snapshot</td></tr>'; return; }
    const head = $('seg-head').offsetHeight, rh = seg.rowH;
    const top = Math.max(0, box.scrollTop - head), h = box.clientHeight || 600;
    const first = Math.max(0, Math.floor(top / rh) - 10), last = Math.min(n, Math.ceil((top + h) / rh) + 10);
    let html = '<tr class="pad" style="height:' + first * rh + 'px"></tr>';
    for (let k = first; k < last; k++) html += segRowHtml(rows[k]);
    body.innerHTML = html + '<tr class="pad" style="height:' + (n - last) * rh + 'px"></tr>' +
      (n ? '' : '<tr><td colspan="9" class="l muted">no segment matches the filter</td></tr>');
    seg.first = first; seg.last = last;
    if (!seg.measured && last > first) {  // the real row height (fonts, borders) once
      const r = body.querySelector('tr.seg');
      const got = r ? r.getBoundingClientRect().height : 0;
      seg.measured = got > 0;
      if (got > 0 && Math.abs(got - rh) > 0.01) { seg.rowH = got; drawSegRows(); }
    }
  }
  function renderSegments() {
    const t0 = performance.now();
    D.segView = segRows();
    for (const th of document.querySelectorAll('#seg-head th[data-sort]')) {
      th.classList.toggle('asc', th.dataset.sort === seg.key && seg.dir > 0);
      th.classList.toggle('desc', th.dataset.sort === seg.key && seg.dir < 0);
    }
    drawSegRows();
    const s = D.stats || {}, shown = D.segView.length;
    $('seg-summary').innerHTML = (shown === D.n_segments ? D.n_segments + ' segments' : shown + ' of ' + D.n_segments + ' segments') + ', ' + D.n_blocks +
      ' blocks at the end state' + (s.reserved_bytes !== undefined ? ' &middot; ' + fmtBytes(s.reserved_bytes) + ' reserved, ' + fmtBytes(s.allocated_bytes) + ' allocated' : '') +
      ' &middot; sorted by ' + seg.key + (seg.dir > 0 ? ' &uarr;' : ' &darr;') + ' &middot; ' + (performance.now() - t0).toFixed(0) + ' ms';
  }
  api.segments = () => ({ total: D.n_segments, shown: (D.segView || []).length, first: seg.first, last: seg.last,
    rendered: document.querySelectorAll('#seg-body tr.seg').length, key: seg.key, dir: seg.dir, rowH: seg.rowH, order: (D.segView || []).slice(0, 50) });
  function setupSegments() {
    $('seg-body').addEventListener('mousemove', (ev) => {
      const t = ev.target.closest('[data-b]');
      if (!t) { hideTip(); return; }
      const b = +t.dataset.b, c = D.col, id = c.blk_alloc[b];
      const head = '<div class="h">' + (c.blk_state[b] === 1 ? 'allocated' : 'pending free') + ' block ' + hex(c.blk_addr[b]) + ', ' + fmtBytes(c.blk_size[b]) + '</div>';
      showTip(head + (id >= 0 ? allocHtml(id) : stackHtml(c.blk_stack[b])), ev.clientX, ev.clientY);
    });
    $('seg-body').addEventListener('mouseleave', hideTip);
    $('seg-scroll').addEventListener('scroll', () => { if (!seg.pending) { seg.pending = true; requestAnimationFrame(drawSegRows); } });
    for (const th of document.querySelectorAll('#seg-head th[data-sort]')) {
      th.addEventListener('click', () => {
        const k = th.dataset.sort;
        if (seg.key === k) seg.dir = -seg.dir; else { seg.key = k; seg.dir = (k === 'index' || k === 'addr' || k === 'stream' || k === 'pool') ? 1 : -1; }
        $('seg-scroll').scrollTop = 0;
        renderSegments();
      });
    }
    const refilter = () => { $('seg-scroll').scrollTop = 0; renderSegments(); };
    $('seg-filter').addEventListener('input', refilter);
    $('seg-pool').addEventListener('change', refilter);
  }

  // ---------------------------------------------------------------- stats
  const BYTE_KEYS = new Set(['reserved_bytes', 'allocated_bytes', 'active_bytes', 'requested_bytes', 'free_bytes', 'largest_free_block', 'rounding_slack_bytes', 'peak_allocated_bytes']);
  // Raw figures the table shows in another form: the peak as '#entry' and seconds from the start.
  const HIDDEN = new Set(['peak_index', 'peak_time_us', 'peak_event', 'peak_time_s']);
  function statRow(k, v, label) {
    let shown;
    if (v === null || v === undefined) shown = '<span class="muted">-</span>';
    else if (k === 'peak_event') shown = 'after event #' + v;
    else if (k === 'duration_s') shown = v.toFixed(4) + ' s';
    else if (/_s$/.test(k)) shown = v.toFixed(4) + ' s <span class="muted">from the start of the run</span>';
    else if (BYTE_KEYS.has(k) || /_bytes$/.test(k)) shown = fmtBytes(v) + ' <span class="muted">(' + v + ')</span>';
    else shown = esc(v);
    return '<tr><th class="l">' + esc(label || k) + '</th><td data-key="' + esc(k) + '" data-value="' + esc(v ?? '') + '">' + shown + '</td></tr>';
  }
  function peakRows(s) { return statRow('peak_event', s.peak_event, 'peak') + (D.has_time ? statRow('peak_time_s', s.peak_time_s, 'peak time') : ''); }
  // A run with no caching allocator (torchmem's tracker, CPU): the storages' own figures.
  function trackedStats(s) {
    const f = s.tracked;
    let html = '<h3>' + esc(D.name) + ': a tracked run</h3><p class="muted">No caching allocator: every segment is one storage, so ' +
      'reserved, free, fragmentation and slack are not figures of this run; these are.</p><table id="stats-table">' +
      statRow('peak_bytes', f.peak_bytes, 'peak live') + statRow('peak_event', f.peak_event, 'peak') +
      (D.has_time ? statRow('peak_time_s', f.peak_time_s, 'peak time') : '') +
      statRow('live_end_bytes', f.live_end_bytes, 'live at the end') + statRow('storages_end', f.storages_end, 'storages live at the end') +
      statRow('allocations', f.allocations, 'allocations') + statRow('frees', f.frees, 'frees') +
      (D.has_time ? statRow('duration_s', f.duration_s, 'duration') : '') + '</table>';
    const bytesTable = (id, title, head, rows) => '<h3>' + title + '</h3><table id="' + id + '"><tr><th class="l">' + head.join('</th><th>') + '</th></tr>' + rows.join('') + '</table>';
    const cell = (k, v) => '<td data-key="' + esc(k) + '" data-value="' + v + '">' + fmtBytes(v) + '</td>';
    html += bytesTable('stats-category', 'By category', ['category', 'live at the peak', 'live at the end'],
      Object.entries(f.by_category).map(([k, r]) => '<tr><th class="l">' + esc(k) + '</th>' + cell(k + ':peak', r.peak) + cell(k + ':end', r.end) + '</tr>'));
    html += bytesTable('stats-phase', 'Live at the peak, by phase of allocation', ['phase', 'bytes'],
      Object.entries(f.by_phase).map(([k, v]) => '<tr><th class="l">' + esc(k) + '</th>' + cell(k, v) + '</tr>'));
    html += bytesTable('stats-module', 'Live at the peak, by module (largest 10)', ['module', 'bytes'],
      Object.entries(f.modules).map(([k, v]) => '<tr><th class="l">' + esc(k) + '</th>' + cell(k, v) + '</tr>'));
    return html;
  }
  function renderStats() {
    const s = D.stats || {};
    let html;
    if (D.tracked && s.tracked) html = trackedStats(s);
    else {
      html = '<h3>Device ' + esc(D.device) + '</h3><table id="stats-table">';
      for (const [k, v] of Object.entries(s)) {
        if ((v !== null && typeof v === 'object') || HIDDEN.has(k)) continue;
        html += statRow(k, v);
        if (k === 'peak_allocated_bytes') html += peakRows(s);
      }
      html += '</table>';
    }
    for (const [k, v] of Object.entries(D.tracked ? {} : s)) {
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
      html += '<h3>Live at the peak (' + fmtBytes(s.peak_allocated_bytes) + ' after event #' + s.peak_event + '), by stack</h3>' +
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
    if (P.allocator_settings && !D.tracked) {
      html += '<h3>Allocator settings</h3><table>';
      for (const [k, v] of Object.entries(P.allocator_settings)) html += '<tr><th class="l">' + esc(k) + '</th><td class="l">' + esc(typeof v === 'object' ? JSON.stringify(v) : v) + '</td></tr>';
      html += '</table>';
    }
    if (P.notes && P.notes.length) html += '<h3>Notes</h3>' + P.notes.map((t) => '<p>' + esc(t) + '</p>').join('');
    html += '<p class="muted">Trace: ' + D.n_events + ' events, ' + D.n_allocs + ' allocations' + (D.has_time ? '' : ', no timestamps') + '.</p>';
    $('stats').innerHTML = html;
  }

