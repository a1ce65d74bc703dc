set -u
for cfg in "16 8 1 2" "8 4 1 3" "8 4 1 2" "8 4 3 2" "8 8 3 1"; do
  set -- $cfg
  LAB_CPT=$1 LAB_BY=$2 LAB_CI_UNROLL=$3 LAB_MINB=$4 LAB_SHIPPED=0 python scripts/inst_wino_lab/run.py 2>&1 | grep -E "Used|spill|randn batch 128|inf |big |back-to-back"
done
so=$(ls scripts/inst_wino_lab/build/libwino_8_4_1_3.so) && cuobjdump -sass $so | grep -E '^\s+/\*[0-9a-f]{4}\*/' | awk '{print $2}' | sed 's/\..*//;s/;//' | sort | uniq -c | sort -rn | head -8
