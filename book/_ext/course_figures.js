// Fit each plotly figure's tick labels to the width it is drawn at (book/_ext/plotly_offline.py loads
// this after plotly.min.js). A figure is built once for every width, and tick labels that sat side by
// side on a laptop run into each other on a phone. So, after every draw: label a log axis at 1, 2 and 5
// of each decade, or at every decade, or every second or third, the first of these whose labels do not
// overlap; and turn an axis's category labels upright when they overlap lying down. Axes whose notebook
// chose their own dtick or tickangle are left alone. A figure's size is its notebook's, never changed
// here: a figure that grew after drawing would spill over the cells around it. When all figures have
// settled, <html data-course-figures="fitted"> tells the browser test to look.
(() => {
  const LOG_STEPS = ['D2', 1, 2, 3];    // log-axis labels: 1-2-5 per decade, then every 1, 2, 3 decades

  function overlapping(gd, ax) {
    const boxes = [...gd.querySelectorAll(`.${ax._id}tick text`)].map(t => t.getBoundingClientRect())
      .filter(r => r.width > 0).sort((a, b) => (a.left - b.left) || (a.top - b.top));
    return boxes.some((a, i) => boxes.slice(i + 1).some(b =>
      a.left < b.right - 1 && b.left < a.right - 1 && a.top < b.bottom - 1 && b.top < a.bottom - 1));
  }

  function update(gd) {
    const fl = gd._fullLayout, out = {};
    for (const k of Object.keys(fl).filter(k => /^[xy]axis\d*$/.test(k))) {
      const ax = fl[k], own = gd.layout[k] || {};
      if (!ax.visible || !ax.showticklabels || !overlapping(gd, ax)) continue;
      if (ax.type === 'log') {
        const at = LOG_STEPS.indexOf(own.dtick ?? 'D2');
        if (at >= 0 && at + 1 < LOG_STEPS.length) out[`${k}.dtick`] = LOG_STEPS[at + 1];
      } else if (ax.type === 'category' && k[0] === 'x' && (own.tickangle ?? 'auto') === 'auto') {
        out[`${k}.tickangle`] = -90;
      }
    }
    return out;
  }

  function fit(gd) {
    if (!gd._fullLayout || !gd._fullLayout._size) return Promise.resolve();
    const out = update(gd);
    if (!Object.keys(out).length) return Promise.resolve();
    return Plotly.relayout(gd, out).then(() => fit(gd));
  }

  function reset(gd) {   // on a resize, start again from each axis's own labels
    const out = {};
    for (const [key, value] of Object.entries(gd._courseOwn || {})) out[key] = value;
    return Object.keys(out).length ? Plotly.relayout(gd, out) : Promise.resolve();
  }

  function remember(gd) {
    if (gd._courseOwn || !gd.layout) return;
    gd._courseOwn = {};
    for (const k of Object.keys(gd.layout).filter(k => /^[xy]axis\d*$/.test(k))) {
      gd._courseOwn[`${k}.dtick`] = gd.layout[k].dtick ?? null;
      gd._courseOwn[`${k}.tickangle`] = gd.layout[k].tickangle ?? null;
    }
  }

  function fitAll(again) {
    const figures = [...document.querySelectorAll('.js-plotly-plot')];
    document.documentElement.dataset.courseFigures = 'fitting';
    figures.forEach(remember);
    return Promise.all(figures.map(gd => (again ? reset(gd) : Promise.resolve()).then(() => fit(gd))))
      .then(() => { document.documentElement.dataset.courseFigures = 'fitted'; });
  }

  let timer;
  window.addEventListener('load', () => fitAll(false));
  window.addEventListener('resize', () => { clearTimeout(timer); timer = setTimeout(() => fitAll(true), 200); });
})();
