  // ---------------------------------------------------------------- ranks of a job
  // Only in pages of a job's rank traces (P.ranks: per rank, its live bytes over the job's one
  // time axis as [t, live] points): the selector picks a rank, and in time mode every rank's
  // curve is drawn over the one shown, so the ranks compare on one axis.
  function setupRanks(sel, selectDevice) {
    sel.parentElement.firstChild.textContent = 'rank ';
    const byPeak = [...P.ranks].sort((a, b) => a.peak - b.peak || a.rank - b.rank);
    P.rankLow = byPeak[0].rank; P.rankHigh = byPeak[byPeak.length - 1].rank;
    api.ranks = () => ({ count: P.ranks.length, world: P.world_size, current: D ? D.rank : null,
      curves: api._tl.rankCurves || 0, mode: tl.mode, x0: tl.x0, x1: tl.x1 });
    api.selectDevice = (i) => { selectDevice(i); drawTimeline(); return api.ranks(); };
  }
  // After a switch of rank: time mode, over the same window as before when there was one.
  function rankView(keep) {
    if (!D.tcum) return;
    tl.mode = 'time'; modeLabels();
    [tl.x0, tl.x1] = keep || [D.tmin, D.tmax];
  }
  function rankNote(timeMode, curves) {
    return ' &middot; ' + (timeMode ? curves + ' rank curves on one time axis (dark: rank ' + D.rank + ')'
      : 'x axis &rarr; time to compare the ranks');
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
      let best = -1, py = 0;
      for (let i = 0; i < r.t.length; i++) {
        const x = ml + (r.t[i] - tl.x0) / span * W, y = mt + H - r.live[i] / ymax * H;
        if (i === 0) ctx.moveTo(x, y); else { ctx.lineTo(x, py); ctx.lineTo(x, y); }  // steps
        py = y;
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
