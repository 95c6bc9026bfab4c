# scripts/devbundle.sh: sourced by scripts/test and scripts/dev. Defines use_devbundle ROOT.
#
# workerd runs Python Workers only with a Pyodide bundle, which it normally downloads. Where the
# project's shared folder has the development-bundle builder (ROOT/../shared/devbundle, as in CI
# and on the developers' machines), use_devbundle builds that bundle offline into
# ROOT/.tmp/pyodide-cache (under 0.3 s when up to date) and exports
#   SEMAPHORE_PYODIDE_CACHE=ROOT/.tmp/pyodide-cache
#   SEMAPHORE_COMPAT_FLAGS=...,python_workers_development   (the harness then adds
#                                                           `serve --experimental`)
# Exit 2 from the builder (a workerd it does not fit) exports SEMAPHORE_WORKERD_SKIP with the
# builder's one-line reason, and tier 3 skips with it. Any other failure prints the builder's
# log and returns 1. Without the folder (a user's clone), or when SEMAPHORE_PYODIDE_CACHE is
# already set, nothing changes: the harness uses that cache, or lets workerd download the
# released bundle, and tier 3 skips with workerd's own reason when it cannot.

use_devbundle() {
    local root="$1" builder="$1/../shared/devbundle/build.sh"
    local cache="$1/.tmp/pyodide-cache" log="$1/.tmp/devbundle.log" brc=0 reason
    [ -f "$builder" ] || return 0
    [ -z "${SEMAPHORE_PYODIDE_CACHE:-}" ] || return 0
    mkdir -p "$root/.tmp"
    bash "$builder" "$cache" "${SEMAPHORE_WORKERD:-$root/node_modules/.bin/workerd}" \
        >"$log" 2>&1 || brc=$?
    if [ "$brc" -eq 0 ]; then
        echo "$(basename "$0"): $(tail -n 1 "$log")"
        export SEMAPHORE_PYODIDE_CACHE="$cache"
        case ",${SEMAPHORE_COMPAT_FLAGS:-}," in
            *,python_workers_development,*) ;;
            *) export SEMAPHORE_COMPAT_FLAGS="${SEMAPHORE_COMPAT_FLAGS:+$SEMAPHORE_COMPAT_FLAGS,}python_workers_development" ;;
        esac
    elif [ "$brc" -eq 2 ]; then
        reason="$(grep -v '^[[:space:]]*$' "$log" | tail -n 1)"
        echo "$(basename "$0"): tier 3 will skip: $reason" >&2
        export SEMAPHORE_WORKERD_SKIP="the development Pyodide bundle does not fit this workerd (../shared/devbundle/build.sh exit 2): $reason"
    else
        cat "$log" >&2
        echo "$(basename "$0"): ../shared/devbundle/build.sh failed (exit $brc)" >&2
        return 1
    fi
}
