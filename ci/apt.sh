# Sourced by ci/setup.sh and ci/bench_peers.sh: apt_install_missing TAG PACKAGE...
# installs only the Debian packages not yet installed (as root, or through sudo if present),
# so the scripts stay safe to run again.
apt_install_missing() {
  local tag=$1 sudo="" p
  shift
  if [ "$(id -u)" != 0 ]; then sudo=$(command -v sudo || true); fi
  local missing=()
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "[$tag] apt-get install ${missing[*]}"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
      "${missing[@]}" >/dev/null
  fi
}
