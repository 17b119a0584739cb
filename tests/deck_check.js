// Every slide of the open deck against a room's bar, read by tests/test_slides.py and
// tests/test_site.py (page.evaluate). Called as ({body, code}) => report, with the least size in
// screen pixels of body text and of code; steps through every slide (Reveal.slide(h, v), all of
// its fragments shown) and returns, for each, {h, v, body, code, images, problems}:
//   body, code  the smallest text on the slide, in screen pixels: the computed font size times
//               every scale between it and the screen (reveal.js' own, and any transform or zoom
//               inside the deck). Code is what sits in a <pre>, a <code> or an output; a formula
//               is measured at its own size (its sub- and superscripts are smaller, as in print).
//               Text still hidden in a fragment counts: it will be shown.
//   images      [natural width, natural height, shown width, shown height, full width] per image,
//               full width: the width at which it fills the slide's width or height
//   problems    text below the bar; a slide, text, code, table or image outside the screen (a box
//               that scrolls holds what it clips, and must itself be on the screen); a slide
//               that scrolls; a line cut off at a box's edge; an image not loaded or shown below
//               the slide's full width; a formula typeset twice.
({body, code}) => {
  const W = innerWidth, H = innerHeight, report = [];
  let scales = new Map();  // an element's own scale times its parent's, for one slide
  const scaleOf = (element, top) => {
    if (!element || element === top) return Reveal.getScale();
    if (!scales.has(element)) {
      const style = getComputedStyle(element), zoom = parseFloat(style.zoom) || 1;
      const own = (style.transform === 'none' ? 1 : new DOMMatrix(style.transform).a) * zoom;
      scales.set(element, own * scaleOf(element.parentElement, top));
    }
    return scales.get(element);
  };
  const clipper = (e, slide) => {
    for (let a = e.parentElement; a && a !== slide; a = a.parentElement)
      if (getComputedStyle(a).overflowY !== 'visible') return a;
    return null;
  };
  const outside = r => r.top < -1 || r.left < -1 || r.bottom > H + 1 || r.right > W + 1;
  const where = r => `${Math.round(r.left)},${Math.round(r.top)}..` +
                     `${Math.round(r.right)},${Math.round(r.bottom)}`;
  const round = x => Math.round(x * 10) / 10;
  for (const target of Reveal.getSlides()) {
    const {h, v} = Reveal.getIndices(target);
    Reveal.slide(h, v, 1000);
    const slide = Reveal.getCurrentSlide(), top = document.querySelector('.reveal .slides');
    scales = new Map();
    const problems = [], sizes = {body: [], code: []}, images = [], seen = new Set();
    const r = slide.getBoundingClientRect();
    if (slide !== target) problems.push('Reveal.slide did not reach the slide');
    if (outside(r)) problems.push(`slide at ${where(r)}, outside the ${W} x ${H} screen`);
    if (slide.scrollHeight > slide.clientHeight + 1)
      problems.push(`slide scrolls: ${slide.scrollHeight} > ${slide.clientHeight} px`);
    const style = getComputedStyle(slide), scale = scaleOf(slide, top);
    const innerW = (slide.clientWidth - parseFloat(style.paddingLeft) -
                    parseFloat(style.paddingRight)) * scale;
    const innerH = (Reveal.getConfig().height - parseFloat(style.paddingTop) -
                    parseFloat(style.paddingBottom)) * scale;
    const walker = document.createTreeWalker(slide, NodeFilter.SHOW_TEXT);
    for (let t = walker.nextNode(); t; t = walker.nextNode()) {
      const text = t.textContent.trim();
      if (!text) continue;
      let e = t.parentElement;
      if (e.closest('aside.notes, script, style, .MJX_Assistive_MathML')) continue;
      e = e.closest('.MathJax_CHTML') || e;
      if (seen.has(e)) continue;
      seen.add(e);
      if (!e.checkVisibility() || !e.getClientRects().length) continue;
      const px = parseFloat(getComputedStyle(e).fontSize) * scaleOf(e, top);
      const kind = e.closest('pre, code, .jp-OutputArea-output') ? 'code' : 'body';
      const bar = kind === 'code' ? code : body;
      sizes[kind].push(px);
      if (px < bar - 0.01)
        problems.push(`${kind} text at ${round(px)} px < ${bar}: "${text.slice(0, 40)}"`);
      const box = clipper(e, slide), q = (box || e).getBoundingClientRect();
      if (outside(q))
        problems.push(`"${text.slice(0, 40)}" at ${where(q)}` + (box ? ' (its box)' : ''));
    }
    for (const math of slide.querySelectorAll('.MathJax_CHTML'))
      if (math.querySelectorAll(':scope > .mjx-math').length > 1)
        problems.push(`formula shown twice: ${math.textContent.slice(0, 20)}`);
    for (const e of slide.querySelectorAll('pre, img, table, .jp-OutputArea-output')) {
      const name = e.tagName + '.' + e.className, box = clipper(e, slide);
      if (!box && outside(e.getBoundingClientRect())) problems.push(`${name} outside the screen`);
      if (getComputedStyle(e).overflowX === 'visible' && e.scrollWidth > e.clientWidth + 1)
        problems.push(`${name} cut: ${e.scrollWidth} > ${e.clientWidth} px`);
      if (e.tagName !== 'IMG') continue;
      if (!(e.complete && e.naturalWidth > 0)) {
        problems.push('image not loaded');
        continue;
      }
      const q = e.getBoundingClientRect();
      const full = Math.min(innerW, innerH * e.naturalWidth / e.naturalHeight);
      images.push([e.naturalWidth, e.naturalHeight, round(q.width), round(q.height), round(full)]);
      if (q.width < full - 2)
        problems.push(`image shown ${round(q.width)} px wide, not ${round(full)} (full size)`);
    }
    report.push({h, v, body: sizes.body.length ? round(Math.min(...sizes.body)) : null,
                 code: sizes.code.length ? round(Math.min(...sizes.code)) : null,
                 images, problems});
  }
  Reveal.slide(0, 0);
  return report;
}
