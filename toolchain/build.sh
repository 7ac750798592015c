#!/usr/bin/env bash
# Builds the Pulumi toolchain offline from the Go module proxy into a cache keyed by
# the pins and recipes, and prints the bin directory on its last line.
#
# A recipe is one line in RECIPES: <output binary> <wrapper module dir> <main package>
# <ldflags version variable> <module whose pinned version it reports>. Adding a tool is a
# wrapper module (go.mod + go.sum that require it at a pinned version) and one line here.
# Concurrent runs (two ./fimfleet commands, CI beside a developer) serialize on a lock file.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=toolchain/pins.env
source "$here/pins.env"
cache_root=${FIMFLEET_CACHE:-$HOME/.cache/fimfleet}

RECIPES=(
  "pulumi cli github.com/pulumi/pulumi/pkg/v3/cmd/pulumi github.com/pulumi/pulumi/sdk/v3/go/common/version.Version github.com/pulumi/pulumi/pkg/v3"
  "pulumi-language-python langhost . main.version github.com/pulumi/pulumi/sdk/v3"
  "actionlint actionlint github.com/rhysd/actionlint/cmd/actionlint github.com/rhysd/actionlint.version github.com/rhysd/actionlint"
)

die() { echo "toolchain: $*" >&2; exit 1; }

command -v go >/dev/null || die "the Go toolchain is missing: install Go >= 1.26 (https://go.dev/dl, or apt-get install golang-1.26) and rerun"
command -v sha256sum >/dev/null || die "sha256sum is missing: apt-get install coreutils"
command -v flock >/dev/null || die "flock is missing: apt-get install util-linux"

key=$( { cat "$here/pins.env" "$here/build.sh"; go version;
         for r in "${RECIPES[@]}"; do read -r _ dir _ _ _ <<<"$r";
           cat "$here/$dir/go.mod" "$here/$dir/go.sum"; cat "$here/$dir"/*.go 2>/dev/null || true; done; } \
       | sha256sum | cut -c1-16)
out="$cache_root/toolchain/$key"
bin="$out/bin"

# One build at a time per cache; a run that waited finds the other's result below.
mkdir -p "$cache_root/toolchain"
exec 9>"$cache_root/toolchain/.lock"
flock 9

if [[ -f "$out/.complete" ]]; then
  echo "toolchain: cached at $bin"
  echo "$bin"
  exit 0
fi

export GOFLAGS=-mod=readonly CGO_ENABLED=0 GOTOOLCHAIN=local
mkdir -p "$bin.tmp"
for r in "${RECIPES[@]}"; do
  read -r name dir pkg versionvar module <<<"$r"
  ( cd "$here/$dir" && go mod download -x 2>/dev/null >/dev/null || die "cannot download modules for $name: is the Go module proxy reachable (GOPROXY=$(go env GOPROXY))?"
    version=$(go list -m -f '{{.Version}}' "$module")
    [[ $module != github.com/pulumi/* || $version == "$PULUMI_GO_VERSION" ]] \
      || die "toolchain/$dir/go.mod pins $module $version, toolchain/pins.env says $PULUMI_GO_VERSION: make them agree"
    echo "toolchain: building $name ($module $version) - the first build takes several minutes" >&2
    go build -trimpath -tags osusergo,grpcnotrace \
      -ldflags "-s -w -X $versionvar=$version" -o "$bin.tmp/$name" "$pkg" ) \
    || die "building $name failed (see the Go output above)"
done

# The language host runs Pulumi's own exec script, and dynamic providers start through
# pulumi-resource-pulumi-python: both ship in the sdk/v3 module at the pinned version.
sdk_dir=$(cd "$here/langhost" && go list -m -f '{{.Dir}}' github.com/pulumi/pulumi/sdk/v3)
install -m 0755 "$sdk_dir/python/cmd/pulumi-language-python-exec" "$bin.tmp/"
install -m 0755 "$sdk_dir/python/dist/pulumi-resource-pulumi-python" "$bin.tmp/"

rm -rf "$bin" && mv "$bin.tmp" "$bin"
touch "$out/.complete"
echo "toolchain: built into $bin" >&2
echo "$bin"
