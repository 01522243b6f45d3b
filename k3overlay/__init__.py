"""vllm-k3-overlay: keep a patch series and overlay files on a pinned vLLM release.

Modules, one concept each:
  errors    exit codes and the one-line errors a user sees
  git       project-agnostic git verbs, each run with the user's git config shut out
  files     writing files: into a tree without following links, reports whole or not at all;
            opening the tool's own files: never through a link, never waiting on a FIFO
  lock      one run at a time per work directory; the cache's lock files; scratch folders
            a killed run's successor can tell from a live run's
  reaper    a watchdog process: no git child outlives the tool, however it dies
  journal   the steps a run takes that outlive a kill, written ahead; the next run recovers
  recovery  how each such step is finished or undone
  publish   switching the user's checkout to the work branch: all or nothing
  interrupts  where Ctrl-C/SIGTERM may stop the tool, and where it waits
  project   where this repo keeps its data (VERSION, patches/, overlay/, overlay.json)
  pipconfig the package index as pip sees it: pip's configuration read by pip, its CA or the system's
  downloads vLLM's release files (sdists, wheels), cached, checked against the index on every use
  untar     extracting a tar archive by tarfile's ``data`` filter's rules, on every Python 3.11
  mirror    a local git mirror of vLLM release sdists, one tagged root commit per release
  releases  upstream vLLM's commit id of each release (releases.json): --vllm-ref <upstream sha>
  source    getting a vLLM checkout at a ref (a repo URL/path, or the mirror)
  series    the patch series: read, check headers, apply with a 3-way fallback, classify
  manifest  the overlay manifest: drift against recorded upstream blobs, laying files, 3-way merge
  verify    byte-compile touched files; resolve imports of touched and deleted modules
  report    the result as human text, JSON, JUnit XML and markdown
  job       the apply job wiring the above together
  export    regenerate patches/ and the manifest from a maintainer's work branch
  wheel     internal vLLM wheels from the patched tree (repack, or vLLM's precompiled build)
  wheelrelease  the release wheel a build reuses: fetched or given, proven to be the release
  wheelentries  what a wheel may hold: the release's files and ours, plain files, safe names
  wheelcheck  checks of a built wheel against its release wheel and the tree
"""
