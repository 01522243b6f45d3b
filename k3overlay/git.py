"""The git layer, one module per concept, gathered under one name (``from . import git``).

  ``gitproc``      how every git process is started (settings, environment, errors)
  ``gitrefs``      refs, branches, the config entries the tool records
  ``gitworktree``  a work tree's state; the temporary worktrees the tool builds in
  ``gitpatch``     git am, mailinfo, apply trials, format-patch, range-diff
  ``gitobjects``   blobs, trees and commits read and written directly; diffs; merges
"""

# ruff: noqa: F401  (re-exports)

from .gitproc import (  # noqa: F401
    Repo,
    PINNED,
    GIT,
    _CARRIED,
    _KEPT_VARIABLES,
    _STOP_WAIT_S,
    GitError,
    first_line,
    _unquote,
    run,
    attempt,
    _cwd,
    _text,
    _execute,
    _stop,
    _environment,
    _carried_config,
    environ,
    user_has_identity,
    refuse_unreadable_config,
    open_repo,
    init_bare,
    clone,
    _z,
    literal,
)

from .gitrefs import (  # noqa: F401
    resolve,
    tags,
    tag,
    is_branch_name,
    is_ref_name,
    current_branch,
    branch_tip,
    object_type,
    reachable_from_refs,
    config_get,
    config_set,
    set_branch,
    log_subjects,
    commit_time,
    commit_trees,
    tree_of,
    is_ancestor,
)
from .gitworktree import (  # noqa: F401
    operation_in_progress,
    untracked_in_the_way,
    work_tree_entries,
    index_entries,
    cut_short,
    is_dirty,
    _WORKTREE_PREFIX,
    NEUTRAL_ATTRIBUTES,
    temporary_worktree,
    _remove_stale_worktrees,
    _tree_of,
    _owner_gone,
    _remove_worktree,
)
from .gitpatch import (  # noqa: F401
    am,
    am_skip,
    am_abort,
    mail_starts,
    _am,
    mailinfo,
    diff_of,
    links_made,
    patch_paths,
    paths_touched,
    apply_errors,
    trial_tree,
    format_patch,
    range_diff,
    patch_ids,
)
from .gitobjects import (  # noqa: F401
    reparent,
    file_mode,
    unmerged_paths,
    stage_exact,
    write_blob,
    tree_entries,
    _ls_tree,
    staged_changes,
    blob_at,
    read_blob,
    tree_files,
    blob_id,
    archive,
    read_files,
    commit_paths,
    changed_paths,
    diff,
    commit_staged,
    merge_file,
    snapshot,
    attributes_at,
)
