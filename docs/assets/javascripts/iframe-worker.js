/* torchmem docs: search for pages opened from disk (file://), with nothing fetched from the web.
 *
 * Browsers refuse `new Worker(url)` for a file:// page, and Material's search runs in a Worker.
 * Material's `offline` plugin writes the search index as a script (search/search_index.js) and
 * expects a Worker stand-in that runs the worker's script in a hidden iframe (it adds one from a
 * CDN unless a polyfill named "iframe-worker" is configured: this file, mkdocs.yml extra.polyfills).
 * The worker's script finds its own folder from `parent.IFrameWorker` and its first
 * <script src>, and awaits what `importScripts` returns, so scripts load asynchronously here.
 * Served over http(s), nothing changes: the browser's own Worker runs.
 */
(function () {
  "use strict";
  if (location.protocol !== "file:") return;

  function IFrameWorker(url) {
    var target = document.createElement("span");  // an EventTarget the page listens on
    var queue = [];
    var ready = false;
    var frame = document.createElement("iframe");
    frame.hidden = true;
    frame.setAttribute("aria-hidden", "true");
    document.documentElement.appendChild(frame);  // about:blank: same origin as the page
    var w = frame.contentWindow;
    var doc = frame.contentDocument;

    function load(src) {
      return new Promise(function (resolve, reject) {
        var s = doc.createElement("script");
        s.src = new URL(src, location.href).href;
        s.onload = function () { resolve(undefined); };
        s.onerror = function () { reject(new Error("cannot load " + s.src)); };
        doc.head.appendChild(s);
      });
    }
    w.importScripts = function () {
      var urls = Array.prototype.slice.call(arguments);
      return urls.reduce(function (p, u) { return p.then(function () { return load(u); }); },
                         Promise.resolve());
    };
    w.postMessage = function (data) {
      target.dispatchEvent(new MessageEvent("message", { data: data }));
    };
    function deliver(data) {
      w.dispatchEvent(new w.MessageEvent("message", { data: data }));
    }
    load(url).then(function () {
      ready = true;
      queue.splice(0).forEach(deliver);
    }, function (err) {
      target.dispatchEvent(new ErrorEvent("error", { error: err, message: String(err) }));
    });

    target.postMessage = function (data) {
      if (ready) deliver(data); else queue.push(data);
    };
    target.terminate = function () { frame.remove(); };
    return target;
  }

  window.IFrameWorker = IFrameWorker;
  window.Worker = IFrameWorker;
})();
