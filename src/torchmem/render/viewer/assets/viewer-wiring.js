  // ---------------------------------------------------------------- wiring
  function showTab(name) {
    activeTab = name;
    for (const b of document.querySelectorAll('#tabs button')) b.classList.toggle('on', b.dataset.tab === name);
    for (const s of document.querySelectorAll('.tab')) s.classList.toggle('on', s.id === 'tab-' + name);
    hideTip();
    if (name === 'timeline') scheduleTimeline();
    if (name === 'state') { renderEventList(); drawState(); }
    if (name === 'segments') { if (!D.segView) renderSegments(); else drawSegRows(); }
    if (name === 'stats') renderStats();
  }
  function selectDevice(i) {
    const keep = P.ranks && D && tl.mode === 'time' ? [tl.x0, tl.x1] : null;
    D = prepareDevice(P.devices[i]);
    st.pos = -1;
    tl.mode = 'event'; modeLabels();
    tl.x0 = 0; tl.x1 = D.N;
    if (P.ranks) rankView(keep);
    $('xmode-wrap').style.display = D.tcum ? '' : 'none';
    $('ev-slider').max = D.n_events;
    $('device').value = String(i);
    tlLegend();
    D.segView = null;
    selectStateEvent(D.n_events);
    showTab(activeTab);
  }
  const hasOom = (d) => d.ooms.length > 0 || ((d.stats || {}).oom_reports || []).length > 0;
  const peakOf = (d) => { const s = d.stats || {}; return s.peak_allocated_bytes ?? s.timeline_peak_bytes ?? s.allocated_bytes ?? 0; };
  // The device the page opens on: the first with an out-of-memory event, else the largest peak.
  function initialDevice() {
    const oom = P.devices.findIndex(hasOom);
    if (oom >= 0) return oom;
    let best = 0;
    P.devices.forEach((d, i) => { if (peakOf(d) > peakOf(P.devices[best])) best = i; });
    return best;
  }
  api.stats = () => Object.assign({ device: D ? D.device : null, events: D ? D.n_events : 0, allocs: D ? D.n_allocs : 0 }, api._tl);
  api.mapStats = () => api._map;
  // The timeline's view and geometry (canvas pixels), for tests that click a given event.
  api.view = () => ({ mode: tl.mode, x0: tl.x0, x1: tl.x1, ml: tl.ml, mt: tl.mt, W: tl.W, H: tl.H, cw: tl.canvas.width, ticks: tl.ticks, tab: activeTab, sel: st.sel });
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
      if (P.ranks) setupRanks(sel, selectDevice);
      P.devices.forEach((d, i) => {
        const o = document.createElement('option');
        o.value = i;
        o.textContent = d.name + ' (' + d.n_events + ' events, peak ' + fmtBytes(peakOf(d)) +
          (d.peak_at ? ' in ' + d.peak_at : '') + ')' + (hasOom(d) ? ' \u26a0 OOM' : '');
        if (hasOom(d)) o.dataset.oom = '1';
        sel.appendChild(o);
      });
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
      const first = initialDevice();
      if (P.devices.length > 1) {
        const d = P.devices[first];
        $('dev-hint').textContent = d.name + (hasOom(d) ? ' ran out of memory' : ' has the largest peak');
      }
      selectDevice(first);
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
