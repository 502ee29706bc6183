#!/usr/bin/env bash
# Each setting is spelled once as a name, in the settings table (settings/src/table.rs, with the
# IVME_* variables in settings/src/vars.rs): the library, the attribute and the command name a
# setting through its row (`ivme_settings::GRAD_ACCUM.name`, `env::GRAD_ACCUM.name`), never as
# a string of their own. This fails on any of those names written as a whole string literal
# ("grad_accum", "IVME_GRAD_ACCUM") in runtime/src, macros or cli/src outside the table; tests
# (test modules, *_tests.rs, tests/ and snapshots/ folders) and comments do not count.
set -euo pipefail
cd "$(dirname "$0")/.."
table=settings/src/table.rs
vars=settings/src/vars.rs

# The names: each row's own name, builder method, attribute key, aliases and launch name, and
# every variable of the launcher contract.
names=$(
  {
    grep -oE '\b(name|builder|attribute|launch): (Some\()?"[a-z_]+"' "$table" | grep -oE '"[a-z_]+"'
    grep -oE 'aliases: &\[[^]]*\]' "$table" | grep -oE '"[a-z_]+"'
    grep -oE 'name: "IVME_[A-Z_]+"' "$vars" | grep -oE '"IVME_[A-Z_]+"'
  } | sort -u
)
[ -n "$names" ] || { echo "check-setting-names.sh: no names found in $table" >&2; exit 1; }

# `ivme profile` is a subcommand, not the setting.
allowed='cli/src/profile_cmd.rs "profile"'

# Library code only: each file up to its test module, without comment lines.
code() {
  find runtime/src macros cli/src -name '*.rs' \
    ! -name '*_tests.rs' ! -path '*/tests/*' ! -path '*/snapshots/*' -print0 |
    xargs -0 awk '
      FNR == 1 { skip = 0; pending = 0 }
      /^[[:space:]]*#\[cfg\(test\)\]/ { pending = 1; next }
      pending && /^[[:space:]]*mod / { skip = 1 }
      { pending = 0 }
      !skip && !/^[[:space:]]*\/\// { print FILENAME ":" FNR ":" $0 }'
}

found=0
while IFS= read -r hit; do
  path=${hit%%:*}
  for name in $(grep -oF "$names" <<<"$hit" | sort -u); do
    if ! grep -qxF "$path $name" <<<"$allowed"; then
      echo "$hit" >&2
      echo "  ^ $name: name the setting through its row in $table" >&2
      found=1
    fi
  done
done < <(code | grep -F "$names" || true)
if [ "$found" = 1 ]; then
  echo "check-setting-names.sh: the lines above spell a setting's name outside the settings table" >&2
  exit 1
fi
