#!/usr/bin/env bash
# Launch BERT pre-training under torchrun on this node: tools/pretrain_gpt.sh with a BERT default
# config (configs/bert_tiny.yaml). Same environment (NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT,
# GPUS_PER_NODE, NPROC, ...) and the same rules: overrides as key=value only.
#
#   tools/pretrain_bert.sh [CONFIG.yaml] [key=value ...]
#
# e.g. tools/pretrain_bert.sh configs/bert_large.yaml data.paths=[/data/wiki_sentences]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
case "${1:-}" in
    -h|--help) sed -n '2,/^set -euo/p' "$here/pretrain_bert.sh" | sed '$d' | sed 's/^# \{0,1\}//'
               echo; echo "Environment: see tools/pretrain_gpt.sh --help"; exit 0 ;;
esac
PTDP_SCRIPT_NAME="pretrain_bert.sh" PTDP_DEFAULT_CONFIG="configs/bert_tiny.yaml" \
    exec bash "$here/pretrain_gpt.sh" "$@"
