"""Objects: blobs, trees and commits read and written directly, diffs and 3-way file merges."""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

from .gitproc import GitError, Repo, _cwd, _execute, _text, _z, attempt, first_line, literal, run


def reparent(repo: Repo, onto: str, commits: list[str]) -> str:
    """Copy ``commits`` (a linear chain, oldest first) onto ``onto`` and move HEAD (and its
    branch) to the copy; return the new tip.

    Each copy keeps its tree, message, author and committer byte for byte, so it
    is the commit ``git am`` would have made on that parent. The index and work
    tree are left as they are: the new tip has the old tip's tree.
    """
    tip = onto
    for sha in commits:
        header, _, message = _execute(["cat-file", "commit", sha], cwd=_cwd(repo))[1].partition(b"\n\n")
        lines = [line for line in header.split(b"\n") if not line.startswith(b"parent ")]
        lines.insert(1, b"parent " + tip.encode())
        commit = b"\n".join(lines) + b"\n\n" + message
        tip = _text(_execute(["hash-object", "-t", "commit", "-w", "--stdin"], cwd=_cwd(repo),
                             stdin=commit)[1]).strip()
    run(repo, "reset", "--soft", tip)
    return tip


def unmerged_paths(repo: Repo) -> list[str]:
    """Paths left with conflict markers by a merge or 3-way am."""
    return sorted(set(_z(run(repo, "diff", "--name-only", "-z", "--diff-filter=U"))))


def stage_exact(repo: Repo, files: dict[str, tuple[bytes, bool]]) -> None:
    """Stage each ``path: (bytes, executable)`` exactly: those bytes, mode 100755 or 100644.

    Written as blobs without filters and put in the index by hand, so no ignore
    rule (``.gitignore``, ``info/exclude``, ``core.excludesFile``), attribute
    (eol, ``ident``, a filter) or ``core.fileMode`` can leave a file out or change it.
    """
    for path, (data, executable) in files.items():
        blob = write_blob(repo, data)
        run(repo, "update-index", "--add", "--cacheinfo", f"{file_mode(executable)},{blob},{path}")


def file_mode(executable: bool) -> str:
    """Git's mode of a regular file: ``100755`` if ``executable``, else ``100644``."""
    return "100755" if executable else "100644"


def write_blob(repo: Repo, data: bytes) -> str:
    """Write ``data`` into ``repo``'s object store as a blob, byte for byte (no filters);
    return its id. To only compute an id, without writing: ``blob_id``."""
    status, out, err = _execute(["hash-object", "-w", "--no-filters", "--stdin"], cwd=_cwd(repo),
                                stdin=data)
    if status != 0:
        raise GitError(f"git hash-object failed: {first_line(_text(err))}")
    return _text(out).strip()


def tree_entries(repo: Repo, ref: str, paths: list[str]) -> dict[str, tuple[str, str]]:
    """``path: (mode, sha)`` at commit ``ref`` for each of ``paths`` that exists there.

    Modes as git writes them: 100644/100755 file, 120000 link, 040000 folder,
    160000 submodule. A path below something that is not a folder is absent.
    """
    return _ls_tree(repo, ref, "--", *paths) if paths else {}


def _ls_tree(repo: Repo, *args: str) -> dict[str, tuple[str, str]]:
    """``path: (mode, sha)`` of each entry ``git ls-tree ARGS`` lists."""
    entries = {}
    for record in run(repo, "ls-tree", "-z", "--full-tree", *args).split("\0"):
        meta, tab, path = record.partition("\t")
        if tab:
            mode, _, sha = meta.split(" ")
            entries[path] = (mode, sha)
    return entries


def staged_changes(repo: Repo) -> bool:
    """True if the index differs from HEAD."""
    return not attempt(repo, "diff", "--cached", "--quiet")[0]


def blob_at(repo: Repo, ref: str, path: str) -> str | None:
    """The blob sha of ``path`` at ``ref``, or None if ``ref`` has no such file."""
    ok, out = attempt(repo, "rev-parse", "--verify", "--quiet", f"{ref}:{path}")
    return out.strip() if ok else None


def read_blob(repo: Repo, sha: str) -> bytes:
    """The bytes of blob ``sha``. Raises GitError if ``repo`` lacks it."""
    status, out, _ = _execute(["cat-file", "blob", sha], cwd=_cwd(repo))
    if status != 0:
        raise GitError(f"blob {sha[:8]} is not in {repo.git_dir}")
    return out


def tree_files(repo: Repo, sha: str, folder: str) -> dict[str, str]:
    """``{path: blob sha}`` of every regular file under ``folder`` at commit ``sha``
    (links and submodules left out)."""
    return {path: blob for path, (mode, blob) in _ls_tree(repo, "-r", sha, "--", folder).items()
            if mode in ("100644", "100755")}


def blob_id(data: bytes, *, width: int = 40) -> str:
    """The blob id git gives ``data`` (``width`` 40: SHA-1 repositories, 64: SHA-256 ones),
    computed here; nothing is written (that is ``write_blob``)."""
    digest = hashlib.sha1 if width == 40 else hashlib.sha256
    return digest(b"blob %d\0" % len(data) + data).hexdigest()


def archive(repo: Repo, sha: str, dest: Path) -> None:
    """Write commit ``sha``'s tree as a tar file ``dest`` (``git archive``)."""
    run(repo, "archive", "--format=tar", "-o", str(dest), sha)


def read_files(repo: Repo, rev: str, paths: list[str]) -> dict[str, bytes]:
    """The bytes at commit ``rev`` of each of ``paths`` that is a file there (one ``git
    cat-file --batch``); a path missing at ``rev`` (or holding a newline) is left out."""
    paths = [path for path in paths if "\n" not in path]
    query = "".join(f"{rev}:{path}\n" for path in paths).encode()
    out = _execute(["cat-file", "--batch"], cwd=_cwd(repo), stdin=query)[1]
    files, pos = {}, 0
    for path in paths:  # "<sha> <type> <size>\n<bytes>\n", or "<query> missing\n"
        end = out.index(b"\n", pos)
        header, pos = out[pos:end].split(b" "), end + 1
        if header[-1] != b"missing":
            size = int(header[2])
            if header[1] == b"blob":
                files[path] = out[pos:pos + size]
            pos += size + 1
    return files


def commit_paths(repo: Repo, sha: str) -> set[str]:
    """Paths commit ``sha`` changes against its first parent."""
    return set(_z(run(repo, "diff-tree", "-z", "--no-commit-id", "--name-only", "-r", "--root",
                      "--no-renames", sha)))


def changed_paths(repo: Repo, old: str, new: str) -> list[str]:
    """Paths that differ between commits ``old`` and ``new`` (a rename: both names)."""
    return sorted(_z(run(repo, "diff", "--name-only", "-z", "--no-renames", old, new)))


def diff(repo: Repo, old: str, new: str, path: str) -> str:
    """Unified diff of ``path`` between commits ``old`` and ``new``."""
    return run(repo, "diff", "--no-color", "--no-ext-diff", "--no-textconv", "--no-renames",
               old, new, "--", *literal([path]))


def commit_staged(repo: Repo, message: str, *, env: dict[str, str]) -> str:
    """Commit what is staged; return HEAD's sha after.

    Nothing to commit is not an error: HEAD stays where it was.
    """
    if staged_changes(repo):
        run(repo, "commit", "--quiet", "-m", message, env=env)  # no hooks: core.hooksPath pinned
    return run(repo, "rev-parse", "HEAD").strip()


def merge_file(ours: Path, base: Path, theirs: Path) -> tuple[bool, bytes]:
    """3-way merge of three files with ``git merge-file``; return (clean, merged bytes)."""
    status, out, _ = _execute(["merge-file", "-p", "-L", "ours", "-L", "base", "-L", "theirs",
                               str(ours), str(base), str(theirs)], cwd=base.parent)
    if status < 0:
        raise GitError(f"git merge-file failed on {ours}")
    return status == 0, out


def snapshot(repo: Repo, directory: Path, message: str, *, env: dict[str, str]) -> str:
    """Commit the whole content of ``directory`` as one new root commit; return its sha.

    Works on a bare ``repo`` through a throwaway index; no branch is moved.
    ``env`` carries the identity and dates, so equal input gives an equal sha.
    """
    with tempfile.TemporaryDirectory(prefix="k3-index-") as tmp:
        env = {**env, "GIT_INDEX_FILE": str(Path(tmp) / "index"), "GIT_WORK_TREE": str(directory)}
        run(repo, "add", "--all", "--force", ".", env=env)
        tree = run(repo, "write-tree", env=env).strip()
        return run(repo, "commit-tree", tree, "-m", message, env=env).strip()


def attributes_at(repo: Repo, sha: str, paths: list[str], names: list[str]) -> dict[str, dict[str, str]]:
    """``{path: {attribute: value}}`` of ``names`` that the ``.gitattributes`` files of commit
    ``sha`` (and ``repo``'s info/attributes) give each of ``paths``, read from a throwaway
    index (``git check-attr --cached``); attributes git leaves unspecified are left out.
    Values as git prints them: ``set``, ``unset`` or the value."""
    if not paths:
        return {}
    with tempfile.TemporaryDirectory(prefix="k3-attr-") as tmp:
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        run(repo, "read-tree", sha, env=env)
        fields = run(repo, "check-attr", "--cached", "-z", *names, "--", *paths, env=env).split("\0")
    found: dict[str, dict[str, str]] = {}
    for path, name, value in zip(fields[0::3], fields[1::3], fields[2::3]):
        if value != "unspecified":
            found.setdefault(path, {})[name] = value
    return found
