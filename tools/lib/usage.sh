# Help text of the tools/ scripts (sourced): their leading comment block is their usage.
#
# header_help FILE: print FILE's comment lines from line 2 up to the first line that is not a
#   comment, with the leading "# " removed.
header_help() {
  sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$1"
}
