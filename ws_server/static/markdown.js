// Markdown answers, rendered without ever parsing HTML.
//
// marked (vendored: marked.esm.js, MIT, see marked.LICENSE.md) splits the text into tokens;
// this module builds DOM nodes from them with `textContent` and `createElement` only. A
// model's answer is untrusted text (a prompt can make a model write anything), so:
// - raw HTML in the answer (`<script>`, `<img onerror=...>`) is shown as the text it is;
// - links go out only to http(s) and mailto, in a new tab, with no referrer and no opener;
// - images are never fetched (a remote image is a way to leak the conversation in its URL):
//   they are shown as a link named by their alt text.
// The Content-Security-Policy of the pages (ws_server/pages.py) would refuse inline script
// anyway; this keeps markup out of the page in the first place.

import { marked } from "./marked.esm.js";

const SAFE_URL = /^(https?:|mailto:)/i;
/** A character reference: the lexer leaves named ones (``&amp;``) for an HTML renderer to decode. */
const ENTITY = /&(?:#\d{1,7}|#x[0-9a-f]{1,6}|[a-z][a-z0-9]{1,31});/gi;
const decoder = document.createElement("textarea"); // detached: its content is text, never markup

/** ``text`` with its character references decoded (one reference at a time, each matched by
 * ``ENTITY`` first, so no markup ever reaches the decoder). */
function decoded(text) {
  if (!text || !text.includes("&")) return text;
  return text.replace(ENTITY, (ref) => {
    decoder.innerHTML = ref;
    return decoder.value;
  });
}

function el(tag, children = [], props = {}) {
  const node = document.createElement(tag);
  Object.assign(node, props);
  node.append(...children);
  return node;
}

function link(rawHref, children, title) {
  const href = decoded(String(rawHref ?? "")).trim(); // checked as the browser would read it
  if (!SAFE_URL.test(href)) return el("span", children); // javascript:, data:, relative
  const a = el("a", children, { href, target: "_blank", rel: "noopener noreferrer nofollow" });
  if (title) a.title = decoded(title);
  return a;
}

function inline(tokens = []) {
  return tokens.map((t) => {
    switch (t.type) {
      case "strong": return el("strong", inline(t.tokens));
      case "em": return el("em", inline(t.tokens));
      case "del": return el("del", inline(t.tokens));
      case "codespan": return el("code", [t.text]);
      case "br": return el("br");
      case "link": return link(t.href, inline(t.tokens), t.title);
      case "image": return link(t.href, [`[image: ${decoded(t.text) || decoded(t.href)}]`], t.title);
      case "checkbox": return el("input", [], { type: "checkbox", checked: t.checked, disabled: true });
      case "text": return t.tokens ? el("span", inline(t.tokens)) : document.createTextNode(decoded(t.text));
      case "escape": return document.createTextNode(t.text); // "\\*": the star, not the backslash
      default: return document.createTextNode(t.raw ?? t.text ?? ""); // html, anything new
    }
  });
}

function block(tokens = []) {
  const out = [];
  for (const t of tokens) {
    switch (t.type) {
      case "space": case "def": break;
      case "paragraph": out.push(el("p", inline(t.tokens))); break;
      case "heading": out.push(el(`h${Math.min(Math.max(t.depth, 1), 6)}`, inline(t.tokens))); break;
      case "code": {
        const code = el("code", [t.text]);
        if (t.lang) code.dataset.lang = String(t.lang).split(/\s/)[0];
        out.push(el("pre", [code]));
        break;
      }
      case "blockquote": out.push(el("blockquote", block(t.tokens))); break;
      case "hr": out.push(el("hr")); break;
      case "list": {
        const items = t.items.map((item) => el("li", listItem(item)));
        const list = el(t.ordered ? "ol" : "ul", items);
        if (t.ordered && Number(t.start) !== 1 && t.start !== "") list.start = Number(t.start);
        out.push(list);
        break;
      }
      case "table": {
        const cell = (tag, c, i) => {
          const node = el(tag, inline(c.tokens));
          if (t.align[i]) node.style.textAlign = t.align[i]; // CSSOM: allowed by the pages' CSP
          return node;
        };
        const head = el("thead", [el("tr", t.header.map((c, i) => cell("th", c, i)))]);
        const body = el("tbody", t.rows.map((row) => el("tr", row.map((c, i) => cell("td", c, i)))));
        out.push(el("div", [el("table", [head, body])], { className: "table" }));
        break;
      }
      case "text": out.push(el("p", t.tokens ? inline(t.tokens) : [decoded(t.text)])); break;
      default: out.push(el("p", [t.raw ?? t.text ?? ""])); // html blocks and anything new: as text
    }
  }
  return out;
}

/** A list item's content: its text runs inline in a tight list (in paragraphs in a loose one),
 * and what else it holds (a nested list, a code block) stays a block. */
function listItem(item) {
  return item.tokens.flatMap((t) => {
    if (t.type === "checkbox") return inline([t]);
    if (t.type === "text" && !item.loose) return inline(t.tokens ?? [t]);
    return block([t]);
  });
}

/** Replace `container`'s children by `text` rendered as Markdown (GitHub-flavoured). */
export function renderMarkdown(container, text) {
  let nodes;
  try {
    nodes = block(marked.lexer(text, { gfm: true }));
  } catch {
    nodes = [document.createTextNode(text)]; // never lose an answer to a parser bug
  }
  container.replaceChildren(...nodes);
}
