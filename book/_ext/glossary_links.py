"""The first use of each glossary term on a page links to its entry in the glossary.

The terms are those of the book's one `{glossary}` directive (book/appendix/glossary.md). On every other
page, the first time a term, or another term of the same entry, appears in prose, that word becomes a
link to the term's anchor (`glossary.html#term-...`), titled with the start of its definition. Code,
literals, math, headings, existing links, raw HTML and notebook cells (their source and their outputs)
are left alone, so the notebooks themselves carry no `{term}` markup and read the same in Jupyter.

Matching is by whole word and exact case, with three allowances: a plural `s`/`es`; a capital first
letter for a lowercase term ("ridge point" matches "Ridge point"); and the lowercase spelling of an
acronym with a digit ("FP16" matches "fp16"). The words of a multi-word term may be split by a line
break or a hyphen ("KV cache" matches "KV-cache"). A change to the glossary rewrites every page.
The links read as the words they are, underlined with dots, and show the definition's start on hover.
Registered in `_config.yml`, `sphinx.local_extensions`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from pathlib import Path

from docutils import nodes
from sphinx import addnodes

CSS = """/* book/_ext/glossary_links.py: a link to the glossary reads as the word it is */
.bd-article a.glossary-link { color: inherit; text-decoration: underline dotted; text-underline-offset: 0.2em; }
.bd-article a.glossary-link:hover { color: var(--pst-color-link-hover); text-decoration-style: solid; }
"""

# a word next to these characters is part of a longer token (a path, `mlx-lm`, `Llama-3.1-8B`)
_BEFORE = r"(?<![\w\-./])"
_AFTER = r"(?![\w]|-\w|\.\w)"
# elements whose text is never prose
_SKIP = (nodes.FixedTextElement, nodes.literal, nodes.math, nodes.raw, nodes.reference, nodes.title,
         nodes.subtitle, nodes.rubric, nodes.term, nodes.comment, nodes.target, nodes.image,
         nodes.substitution_definition, nodes.abbreviation, addnodes.pending_xref, addnodes.desc_signature,
         addnodes.glossary, addnodes.toctree)


def _variants(term: str) -> list[str]:
    """The spellings of `term` that count as a use of it (before the plural ending)."""
    spellings = [term]
    if term[:1].islower():
        spellings.append(term[0].upper() + term[1:])
    if not any(c.islower() for c in term) and any(c.isdigit() for c in term):
        spellings.append(term.lower())
    return spellings


def _pattern(spelling: str) -> str:
    words = [re.escape(w) for w in re.split(r"[ \-]", spelling)]
    seps = re.findall(r"[ \-]", spelling)
    body = words[0]
    for sep, word in zip(seps, words[1:]):
        body += (r"(?:\s+|-)" if sep == " " else r"-") + word
    return body + ("(?:s|es)?" if spelling[-1:].isalnum() else "")


def term_regex(terms: Iterable[str]) -> tuple[re.Pattern, list[str]]:
    """One regex with a group per term, longest spellings first, and the term of each group."""
    order = sorted(set(terms), key=lambda t: (-len(t), t))
    groups = ["(" + "|".join(_pattern(s) for s in sorted(_variants(t), key=len, reverse=True)) + ")"
              for t in order]
    return re.compile(_BEFORE + "(?:" + "|".join(groups) + ")" + _AFTER), order


def _is_prose(text: nodes.Text) -> bool:
    node = text.parent
    while node is not None:
        if isinstance(node, _SKIP):
            return False
        if isinstance(node, nodes.Element) and (str(node.get("nb_element", "")).startswith("cell_code")
                                                or "cell_output" in node.get("classes", ())):
            return False
        node = node.parent
    return True


def _merge_texts(doctree: nodes.Node) -> None:
    """Join neighbouring text nodes of prose (MyST makes each line break a node of its own), so that
    a term split over two lines of the source is found."""
    for parent in list(doctree.findall(nodes.Element)):
        i = 0
        while i < len(parent.children):
            j = i
            while j < len(parent.children) and isinstance(parent.children[j], nodes.Text):
                j += 1
            if j - i > 1 and _is_prose(parent.children[i]):
                parent[i:j] = [nodes.Text("".join(str(t) for t in parent.children[i:j]))]
                i += 1
            else:
                i = max(j, i + 1)


def link_first_uses(doctree: nodes.Node, regex: re.Pattern, order: list[str],
                    target: Callable[[str], tuple[str, str, str] | None]) -> list[str]:
    """Turn the first prose use of each entry's terms into a link. `target(term)` gives the term's
    (uri, entry, title), `entry` naming the glossary entry (its terms are linked once between them),
    or None for a term not to link. Returns the terms linked, in order."""
    done: set[str] = set()
    linked: list[str] = []
    _merge_texts(doctree)
    for text in list(doctree.findall(nodes.Text)):
        if not _is_prose(text):
            continue
        source, pieces, at = str(text), [], 0
        for m in regex.finditer(source):
            term = order[m.lastindex - 1]
            found = target(term)
            if found is None or found[1] in done:
                continue
            uri, entry, title = found
            done.add(entry)
            linked.append(term)
            pieces.append(nodes.Text(source[at:m.start()]))
            ref = nodes.reference("", "", internal=True, refuri=uri, reftitle=title, classes=["glossary-link"])
            ref += nodes.inline(m.group(), m.group(), classes=["xref", "std", "std-term"])
            pieces.append(ref)
            at = m.end()
        if pieces:
            if at < len(source):
                pieces.append(nodes.Text(source[at:]))
            text.parent.replace(text, [p for p in pieces if not isinstance(p, nodes.Text) or str(p)])
    return linked


def _glossary(app) -> dict[str, tuple[str, str, str, str]]:
    """term -> (docname, anchor, entry, title), from the glossary's doctree; cached per process."""
    env = app.env
    cached = getattr(app, "_glossary_links_terms", None)
    if cached is not None and cached[0] == env.all_docs.get(cached[1]):
        return cached[2]
    std = env.get_domain("std")
    terms = {name: where for (kind, name), where in std.objects.items() if kind == "term"}
    found: dict[str, tuple[str, str, str, str]] = {}
    for docname in sorted({d for d, _ in terms.values()}):
        for item in env.get_doctree(docname).findall(nodes.definition_list_item):
            names = [t.astext() for t in item.findall(nodes.term)]
            if not names or names[0] not in terms:
                continue
            definition = next(item.findall(nodes.definition), None)
            title = " ".join(definition.astext().split()) if definition is not None else ""
            title = re.sub(r"\\(?=[a-zA-Z])|[{}]", "", re.sub(r"\\[,;!]", " ", title))  # math as "alpha", "10^12"
            title = title if len(title) <= 160 else title[:157].rsplit(" ", 1)[0] + "…"
            for name in names:
                if name in terms:
                    found[name] = (terms[name][0], terms[name][1], terms[names[0]][1], title)
    docname = next(iter(found.values()))[0] if found else ""
    app._glossary_links_terms = (env.all_docs.get(docname), docname, found)
    return found


def _link(app, doctree, docname) -> None:
    glossary = _glossary(app)
    if not glossary or docname in {d for d, *_ in glossary.values()}:
        return
    key = tuple(sorted(glossary))
    if getattr(app, "_glossary_links_regex", (None,))[0] != key:
        app._glossary_links_regex = (key, *term_regex(glossary))
    _, regex, order = app._glossary_links_regex

    def target(term):
        doc, anchor, entry, title = glossary[term]
        return app.builder.get_relative_uri(docname, doc) + "#" + anchor, entry, title

    link_first_uses(doctree, regex, order, target)


def _note_read(app, env, docnames) -> None:
    app._glossary_links_reread = set(docnames)


def _rewrite_all(app, env) -> list[str]:
    """When the glossary was read again, every page is written again with its links."""
    read = getattr(app, "_glossary_links_reread", set())
    std = env.get_domain("std")
    if read & {d for (kind, _), (d, _) in std.objects.items() if kind == "term"}:
        return sorted(env.found_docs)
    return []


def _add_css(app) -> None:
    if app.builder.format != "html":
        return
    static = Path(app.outdir) / "_static"
    static.mkdir(parents=True, exist_ok=True)
    (static / "glossary_links.css").write_text(CSS)
    app.add_css_file("glossary_links.css")


def setup(app):
    app.connect("builder-inited", _add_css)
    app.connect("env-before-read-docs", _note_read)
    app.connect("env-get-updated", _rewrite_all)
    app.connect("doctree-resolved", _link)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
