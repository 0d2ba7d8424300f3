// Fit each plotly figure of the page to the width it is drawn at (book/_ext/plotly_offline.py loads
// this after plotly.min.js). A figure is built once for every width; on a phone its legend rows can
// take most of its height, and a log axis's labels 1, 2, 5 no longer fit between its decades. So,
// after every draw: grow the figure until its plot is at least MIN_PLOT_PX tall, and label each log
// axis at 1, 2 and 5 of every decade where they fit, else at every decade (an axis whose notebook
// set a dtick other than these two is left alone). When all figures have settled,
// <html data-course-figures="fitted"> tells the browser test to look.
(() => {
  const MIN_PLOT_PX = 220;       // plot height below which a figure grows
  const PX_PER_DECADE = {x: 170, y: 70};   // room for the labels 1, 2, 5 of one decade (x: "2,000" is wide)

  function update(gd) {
    const fl = gd._fullLayout, out = {};
    if (gd._courseBase === undefined) gd._courseBase = fl.height;
    const height = Math.round(Math.max(gd._courseBase, fl.height + MIN_PLOT_PX - fl._size.h));
    if (Math.abs(height - fl.height) > 4) out.height = height;
    for (const k of Object.keys(fl).filter(k => /^[xy]axis\d*$/.test(k) && fl[k].type === 'log')) {
      const own = (gd.layout[k] || {}).dtick;
      if (own !== undefined && own !== null && own !== 'D2' && own !== 1) continue;
      const x = k[0] === 'x', span = (x ? fl._size.w : fl._size.h) * (fl[k].domain[1] - fl[k].domain[0]);
      const want = span / Math.abs(fl[k].range[1] - fl[k].range[0]) >= PX_PER_DECADE[k[0]] ? 'D2' : 1;
      if (own !== want) out[`${k}.dtick`] = want;
    }
    return out;
  }

  function fit(gd) {
    if (!gd._fullLayout || !gd._fullLayout._size) return Promise.resolve();
    const out = update(gd);
    if (!Object.keys(out).length) return Promise.resolve();
    if (out.height) gd.style.height = `${out.height}px`;
    return Plotly.relayout(gd, out).then(() => fit(gd));
  }

  function fitAll() {
    const figures = [...document.querySelectorAll('.js-plotly-plot')];
    document.documentElement.dataset.courseFigures = 'fitting';
    return Promise.all(figures.map(fit)).then(() => { document.documentElement.dataset.courseFigures = 'fitted'; });
  }

  let timer;
  window.addEventListener('load', fitAll);
  window.addEventListener('resize', () => { clearTimeout(timer); timer = setTimeout(fitAll, 200); });
})();
