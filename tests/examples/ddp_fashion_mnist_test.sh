#!/usr/bin/env bash
# examples/ddp_fashion_mnist as a user runs it: two ranks under elastic-run
# on a subset of Fashion-MNIST, uneven shards (6001 images in batches of 50:
# 61 and 60 batches, so Join shadows one step). Passes when the printed
# test accuracy clears a bar far above chance (0.10).
#
#   ddp_fashion_mnist_test.sh train ELASTIC_RUN EXAMPLE MIN_ACCURACY EPOCHS
#   ddp_fashion_mnist_test.sh corrupt ELASTIC_RUN EXAMPLE
#
# The data set is a declared dependency (deploy/install-deps.sh): without
# it the test fails, saying so; it never skips.
set -euo pipefail
mode=$1 elastic_run=$2 example=$3
# TRELLIS_FASHION_MNIST_DIR: elsewhere than the package's folder.
data=${TRELLIS_FASHION_MNIST_DIR:-/usr/share/datasets/fashion-mnist}

fail() {
  echo "FAIL: $*" >&2
  exit 1
}

for f in train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz \
  t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz; do
  [[ -r $data/$f ]] || fail "$data/$f not found: install the Debian package" \
    "dataset-fashion-mnist (deploy/install-deps.sh does)"
done

run() {
  timeout 150 "$elastic_run" --standalone --nproc-per-node "$1" \
    "$example" "${@:2}" 2>&1
}

case $mode in
train)
  min=$4 epochs=$5
  start=$SECONDS
  if ! out=$(run 2 --data-dir "$data" --epochs "$epochs" --train-limit 6001 \
    --batch-size 50 --test-limit 1000 --seed 1 --lr 0.05); then
    echo "$out"
    fail "the example failed"
  fi
  echo "$out"
  echo "took $((SECONDS - start)) s"
  grep -q "121 batches over 2 ranks" <<<"$out" ||
    fail "expected 61 + 60 = 121 batches per epoch (uneven shards)"
  acc=$(grep -oE 'final test accuracy [0-9.]+' <<<"$out" | awk '{print $4}')
  [[ -n $acc ]] || fail "no 'final test accuracy' line"
  awk -v a="$acc" -v m="$min" 'BEGIN { exit !(a >= m) }' ||
    fail "test accuracy $acc is below $min"
  echo "PASS: test accuracy $acc >= $min"
  ;;
corrupt)
  # A truncated gzip stream and a complete gzip of a truncated idx file:
  # each a clear error naming the file, not a crash or garbage.
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  cp "$data"/*.gz "$tmp"/
  head -c 100000 "$data/train-images-idx3-ubyte.gz" \
    >"$tmp/train-images-idx3-ubyte.gz"
  out=$(run 1 --data-dir "$tmp" --epochs 1) && fail "accepted a cut gzip"
  echo "$out"
  grep -q "train-images-idx3-ubyte.gz: corrupt or truncated" <<<"$out" ||
    fail "the error does not name the truncated file"
  cp "$data/train-images-idx3-ubyte.gz" "$tmp/"
  zcat "$data/t10k-labels-idx1-ubyte.gz" | head -c 5000 | gzip \
    >"$tmp/t10k-labels-idx1-ubyte.gz"
  out=$(run 1 --data-dir "$tmp" --epochs 1) && fail "accepted a cut idx file"
  echo "$out"
  grep -q "t10k-labels-idx1-ubyte.gz: truncated (its header promises 10000" \
    <<<"$out" || fail "the error does not name the truncated idx file"
  echo "PASS"
  ;;
*) fail "unknown mode $mode" ;;
esac
