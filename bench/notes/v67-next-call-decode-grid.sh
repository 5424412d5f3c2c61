#!/bin/bash
# A device call (v67; about 320 s on an H100 in v66): `bench --decode`'s whole grid (816 cells)
# at HEAD: v67's hd64 decode tile and paged split rule against v66's grid (results/h100-decode.*,
# the kernels before them). v66's call, run again.
exec bash "$(dirname "$0")/v66-next-call-decode-grid.sh"
