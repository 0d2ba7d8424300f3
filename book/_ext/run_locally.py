"""From the page to the reader's own machine: the repository's link, and a "Run it locally" box.

The repository is found where the book is built: `BOOK_REPOSITORY_URL` if set, else GitHub Actions'
`GITHUB_SERVER_URL`/`GITHUB_REPOSITORY` (the publishing workflow, .github/workflows/book.yml), else
the checkout's `origin` remote. When one is found, the box starts with `git clone`, and the theme shows
its repository button and the Binder and Colab launch buttons (`_config.yml`, `launch_buttons`) if it knows the
host; when none is (a copy with no remote), the box starts from the copy's root and no page offers a launch.

Every page made from a notebook gets the box under its title: the exact commands that set up the
course's environment and open this notebook in JupyterLab, since a downloaded `.ipynb` alone cannot
import `ref_impl`. Registered in `_config.yml`, `sphinx.local_extensions`.
"""

from __future__ import annotations

import html
import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def repository_url(env: dict[str, str] | None = None, remote: str | None = None) -> str | None:
    """The repository's https address, or None. `remote` stands for `git remote get-url origin`."""
    env = os.environ if env is None else env
    if env.get("BOOK_REPOSITORY_URL"):
        return env["BOOK_REPOSITORY_URL"].rstrip("/")
    if env.get("GITHUB_REPOSITORY"):
        return f"{env.get('GITHUB_SERVER_URL', 'https://github.com').rstrip('/')}/{env['GITHUB_REPOSITORY']}"
    if remote is None:
        run = subprocess.run(["git", "-C", str(ROOT), "remote", "get-url", "origin"],
                             capture_output=True, text=True)
        remote = run.stdout.strip() if run.returncode == 0 else ""
    m = re.match(r"^(?:git@([^:]+):|ssh://git@([^/]+)/|https?://(?:[^@/]+@)?([^/]+)/)(.+?)(?:\.git)?/?$", remote)
    return f"https://{m[1] or m[2] or m[3]}/{m[4]}" if m else None


def theme_knows(url: str) -> bool:
    """Whether sphinx-book-theme can draw a repository button for `url`: it names GitHub, GitLab and
    Bitbucket hosts only, and stops the build on any other."""
    return any(host in url.lower() for host in ("github", "gitlab", "bitbucket"))


def commands(notebook: str, url: str | None) -> list[str]:
    """The shell lines that take a reader from nothing to `notebook` (a path from the repository root)
    open in JupyterLab, with `ref_impl` importable."""
    start = [f"git clone {url}", f"cd {url.rsplit('/', 1)[-1]}"] if url else ["cd path/to/your/copy   # its root"]
    return start + ["make lab            # .venv with MLX, ref_impl and JupyterLab (a minute or two, nothing to compile)",
                    f".venv/bin/jupyter lab {notebook}"]


def box(notebook: str, url: str | None) -> str:
    """The HTML of the "Run it locally" box for one notebook page."""
    code = html.escape("\n".join(commands(notebook, url)))
    where = (f'from <a href="{html.escape(url)}">the repository</a>' if url else "from the course's repository")
    return ('<details class="run-locally admonition tip"><summary class="admonition-title">'
            "Run it locally</summary>"
            f"<p>This page is a notebook. It imports the course's engine, <code>ref_impl</code>, so run it "
            f"{where}, not as a downloaded file alone:</p>"
            f'<div class="highlight"><pre>{code}</pre></div>'
            "<p>Live cells then measure your machine; exercise cells keep your code.</p></details>")


def branch(env: dict[str, str] | None = None) -> str:
    """The branch the book is published from: `BOOK_REPOSITORY_BRANCH`, GitHub Actions' `GITHUB_REF_NAME`, or main
    (Jupyter Book's own default, master, would send the Binder and Colab buttons to a branch that does not exist)."""
    env = os.environ if env is None else env
    return env.get("BOOK_REPOSITORY_BRANCH") or env.get("GITHUB_REF_NAME") or "main"


SETUP_TAG = "course-setup"   # the first code cell of every notebook, removed from the book's pages


def setup_cell(notebook: str) -> str:
    """The source of the first code cell of `notebook` (a path from the repository's root): nothing where the
    course is installed (`make lab`, `make setup`, Binder); where it is not (Colab, a notebook opened alone),
    it fetches the course from COURSE_REPOSITORY, installs the notebooks' set and moves into the notebook's
    folder, or says in one line how to."""
    folder = notebook.rsplit("/", 1)[0]
    return f"""# Setup: the course's engine, ref_impl, is installed by `make lab`, `make setup` or Binder, and then this
# cell does nothing. Elsewhere (Colab, a notebook opened alone) it fetches the course from COURSE_REPOSITORY.
import importlib.util
import os
import subprocess
import sys

if importlib.util.find_spec("ref_impl") is None:
    repository = os.environ.get("COURSE_REPOSITORY")
    if not repository:
        raise RuntimeError("this notebook needs the course's engine: clone the course and run `make lab`, or set "
                           "os.environ['COURSE_REPOSITORY'] to its git URL and run this cell again")
    course = os.path.expanduser("~/local-inference-course")
    if not os.path.isdir(course):
        subprocess.run(["git", "clone", "--depth", "1", repository, course], check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "-r", f"{{course}}/requirements-lab.txt"], check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "-e", course], check=True)
    sys.path.insert(0, course)
    os.chdir(f"{{course}}/{folder}")
"""


def _set_repository(app, config) -> None:
    url = config.book_repository_url = repository_url()
    if url and theme_knows(url):
        # the repository button, and the launch buttons (_config.yml, launch_buttons) that read the same options
        options = dict(config.html_theme_options or {})
        options.update(repository_url=url, use_repository_button=True, use_issues_button=True,
                       repository_branch=branch(), path_to_docs="")
        config.html_theme_options = options


def _add_box(app, pagename, templatename, context, doctree) -> None:
    source = Path(app.env.doc2path(pagename)) if pagename in app.env.all_docs else None
    body = context.get("body")
    if source is None or source.suffix != ".ipynb" or not body:
        return
    notebook = source.resolve().relative_to(Path(app.srcdir).resolve()).as_posix()   # from the book's root
    at = body.find("</h1>")
    at = at + len("</h1>") if at >= 0 else 0
    context["body"] = body[:at] + box(notebook, app.config.book_repository_url) + body[at:]


def setup(app):
    app.add_config_value("book_repository_url", None, "html")
    app.connect("config-inited", _set_repository)
    app.connect("html-page-context", _add_box)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
