#!/bin/sh
# Commit subjects are at most 72 characters; the detail goes in the body.
# Checks every commit since BASE (default: the last commit before the rule
# was checked), or only HEAD where BASE is not in this clone's history.
# Usage: scripts/check-commits.sh [BASE]
cd "$(dirname "$0")/.." || exit 1
base=${1:-7690f11120a28d884627a1b3b17eccbabba43f3c}
if git cat-file -e "$base^{commit}" 2>/dev/null; then
  range="$base..HEAD"
else
  range="-1 HEAD"
fi
subjects=$(git log --format='%s' $range) || { echo "check-commits: not a git checkout" >&2; exit 1; }
long=$(printf '%s\n' "$subjects" | awk 'length($0) > 72')
if [ -n "$long" ]; then
  echo "Commit subjects over 72 characters:" >&2
  echo "$long" >&2
  exit 1
fi
echo "commit subjects: $(printf '%s\n' "$subjects" | wc -l) checked, none over 72 characters"
