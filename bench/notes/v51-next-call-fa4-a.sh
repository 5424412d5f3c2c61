#!/bin/bash
# The grid beside FA4, call 1 of 2 (a few seconds): FA4's first part stashed in /tmp, which the
# machine keeps about 30 s after a call, so call 2 must follow at once. Pack FA4 here first:
# `bash ../shared/peers/fa4/pack.sh .device/fa4` (git-ignored), and
# `cp ../shared/peers/fa4/install.sh .device/fa4/b/` (the GPU machine has no shared/).
# Run as `bash bench/notes/v51-next-call-fa4-a.sh` with carry [".device/fa4/a"].
cd "$(dirname "$0")/../.."
mkdir -p /tmp/fa4stash && cp .device/fa4/a/* /tmp/fa4stash/ && echo "fa4: stashed $(ls /tmp/fa4stash | wc -l) files"
