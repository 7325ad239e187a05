#!/usr/bin/env bash
# Real corpora for users with internet. NanoEuler trains offline on its
# embedded corpus (data/); this script fetches more text for bigger runs.
#
#   bash get_data.sh books       # ~40 Project Gutenberg books -> data/books/*.txt (~25 MB)
#   bash get_data.sh shakespeare # tinyshakespeare again, from char-rnn (the embedded copy is identical)
#   bash get_data.sh strip IN OUT  # strip the Gutenberg header/footer of one raw file (used by books)
#
# Then: python nanoeuler.py train --data data/books
#       python nanoeuler_cuda.py train big --data data/books
set -euo pipefail
cd "$(dirname "$0")"

# Project Gutenberg numbers of well-known public-domain books in English
BOOKS="1342 98 2701 11 1661 120 35 46 84 1080 174 345 768 1260 2542 4300 5200 6130 1952 16 \
       158 1400 219 2591 3207 36 43 514 730 1184 996 2600 1232 205 135 145 28054 244 55 1497"

strip_gutenberg() {
    # the procedure of data/SOURCES.md: drop BOM and CR, keep what lies between the
    # START and END markers (a marker may wrap onto the next line), drop a trailing
    # "End of the Project Gutenberg..." line and a leading "Produced by" paragraph
    python3 - "$1" "$2" <<'EOF'
import re, sys
src, dst = sys.argv[1], sys.argv[2]
text = open(src, encoding="utf-8", errors="replace").read().lstrip("\ufeff").replace("\r\n", "\n")
lines = text.split("\n")
start_re = re.compile(r"^\s*\*\*\*\s*START OF (THE|THIS) PROJECT GUTENBERG EBOOK", re.I)
end_re = re.compile(r"^\s*\*\*\*\s*END OF (THE|THIS) PROJECT GUTENBERG EBOOK", re.I)
start = next((i for i, l in enumerate(lines) if start_re.match(l)), None)
if start is None:
    sys.exit(f"{src}: no Project Gutenberg START marker found")
while not lines[start].rstrip().endswith("***") and start + 1 < len(lines):
    start += 1                                  # the marker wraps onto the next line
end = next((i for i in range(start + 1, len(lines)) if end_re.match(lines[i])), len(lines))
body = [l.rstrip() for l in lines[start + 1:end]]
while body and not body[-1]:
    body.pop()
if body and re.match(r"^\s*End of (the )?Project Gutenberg", body[-1], re.I):
    body.pop()
while body and not body[0]:
    body.pop(0)
if body and body[0].startswith("Produced by"):
    while body and body[0]:
        body.pop(0)                             # the credit paragraph
while body and not body[0]:
    body.pop(0)
while body and not body[-1]:
    body.pop()
open(dst, "w", encoding="utf-8").write("\n".join(body) + "\n")
EOF
}

case "${1:-}" in
books)
    mkdir -p data/books
    for n in $BOOKS; do
        out="data/books/pg$n.txt"
        [ -s "$out" ] && continue
        echo "fetching Project Gutenberg #$n"
        curl -fsSL "https://www.gutenberg.org/cache/epub/$n/pg$n.txt" -o "/tmp/pg$n.raw" \
            || { echo "  could not fetch #$n, skipping"; continue; }
        strip_gutenberg "/tmp/pg$n.raw" "$out"
        rm -f "/tmp/pg$n.raw"
    done
    du -sh data/books
    ;;
shakespeare)
    curl -fsSL https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt \
        -o data/tinyshakespeare.txt
    ;;
strip)
    strip_gutenberg "$2" "$3"
    ;;
*)
    sed -n '2,12p' "$0"
    exit 1
    ;;
esac
