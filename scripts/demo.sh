#!/usr/bin/env bash
# The main job on the embedded default: set up, start one storage node on a free port with a
# generated sample dataset, mount it with batchfs, and read through the mount the way a
# training loader does. Interactive runs keep everything up until Enter; then (and on any
# error) the mount is unmounted and the server stopped.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

work=${BATCHFS_DEMO_DIR:-/tmp/batchfs-demo}
rm -rf "$work"
mkdir -p "$work"/{data,mnt,cache}
bin=$PWD/.venv/bin
server_pid=""
cleanup() {
    if mountpoint -q "$work/mnt"; then "$bin/batchfs" umount "$work/mnt" || fusermount3 -uz "$work/mnt"; fi
    if [ -n "$server_pid" ]; then kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; fi
}
trap cleanup EXIT

"$bin/batchfs-server" --listen 127.0.0.1:0 --data "$work/data" > "$work/server.log" 2>&1 &
server_pid=$!
url=""
for _ in $(seq 1 150); do  # up to 30 s
    url=$(grep -o 'http://[0-9.:]*' "$work/server.log" | head -n1 || true)
    if [ -n "$url" ] && curl -fs "$url/v1/health" >/dev/null; then break; fi
    kill -0 "$server_pid" 2>/dev/null || { cat "$work/server.log"; exit 1; }
    sleep 0.2
done
[ -n "$url" ] || { echo "demo: server did not start"; cat "$work/server.log"; exit 1; }
echo "demo: server at $url (data in $work/data)"

"$bin/python" scripts/make_sample_dataset.py "$work/dataset" --samples 2000
"$bin/batchfs" put "$work/dataset" "$url/demo"

"$bin/batchfs" mount "$url/demo" "$work/mnt" --cache-dir "$work/cache" --cache-quota 1G
echo "demo: mounted $url/demo at $work/mnt"
ls "$work/mnt"
echo "demo: $(find "$work/mnt" -type f | wc -l) files through the mount"
"$bin/python" scripts/demo_loader.py "$work/mnt"   # cold reads: nothing fetched yet
diff -r "$work/dataset" "$work/mnt" && echo "demo: every file reads back byte-exact"

if [ -t 0 ]; then
    read -r -p "demo: mounted at $work/mnt — press Enter to unmount and stop the server. "
fi
