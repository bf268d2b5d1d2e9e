# A CPU workload whose state proves a restore continued exactly: a counter and a hash chain over
# every value so far (h_i = (31*h_{i-1} + i) mod 1000000007), one line per step, appended (O_APPEND,
# which CRIU does not size-check on restore) to /out/counter.log.
i=0
h=0
while :; do
  i=$((i + 1))
  h=$(( (h * 31 + i) % 1000000007 ))
  echo "$i $h" >> /out/counter.log
  sleep 0.02
done
