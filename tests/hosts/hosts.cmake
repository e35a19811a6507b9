# Multi-host tests on pretend hosts (scripts/pretend-hosts.sh): hosts made of Linux namespaces that
# Open MPI sees as separate machines, TCP between them. Label "hosts"; they run in the Release
# pass. Where namespaces cannot be made (not root, no ip/unshare/nsenter) every test here reports
# itself skipped (exit 77) with the reason. Two sets per build tree, of 2 and of 4 hosts, each a
# CTest fixture: brought up before the first test that needs it, removed after the last (also
# after failures; `up` also removes what an interrupted run of the same build tree left).
string(MD5 moe_ep_hosts_id "${CMAKE_BINARY_DIR}")
string(SUBSTRING "${moe_ep_hosts_id}" 0 8 moe_ep_hosts_id)
set(moe_ep_hosts_script ${PROJECT_SOURCE_DIR}/scripts/pretend-hosts.sh)
set(moe_ep_hosts_dir ${CMAKE_CURRENT_SOURCE_DIR}/hosts)
# Each rank's environment (pretend hosts inherit the launcher's).
set(moe_ep_hosts_env "${MOE_EP_MPI_ENV};MOE_EP_TIMEOUT_SECS=60")
# Nothing left behind in /dev/shm, nor as Open MPI session directories: hosts.shm_before lists the
# names there that the tests could create (those of this build tree's sets) before the first of
# them, hosts.shm_after fails for every such name that is new after the last, after the sets were
# taken down (fixture hosts_shm, which every test below requires, up and down included).
set(moe_ep_hosts_shm_list ${CMAKE_CURRENT_BINARY_DIR}/hosts_shm_before.txt)
add_test(NAME hosts.shm_before COMMAND ${moe_ep_hosts_dir}/shm_check.sh before ${moe_ep_hosts_shm_list} ${moe_ep_hosts_id})
set_tests_properties(hosts.shm_before PROPERTIES LABELS hosts FIXTURES_SETUP hosts_shm TIMEOUT 60)
add_test(NAME hosts.shm_after COMMAND ${moe_ep_hosts_dir}/shm_check.sh after ${moe_ep_hosts_shm_list} ${moe_ep_hosts_id})
set_tests_properties(hosts.shm_after PROPERTIES LABELS hosts FIXTURES_CLEANUP hosts_shm SKIP_RETURN_CODE 77 TIMEOUT 60)
foreach(count 2 4)
  set(set_${count} ${moe_ep_hosts_id}-${count})
  add_test(NAME hosts.up_${count} COMMAND ${moe_ep_hosts_script} up ${set_${count}} ${count})
  set_tests_properties(hosts.up_${count} PROPERTIES LABELS hosts FIXTURES_SETUP hosts_${count} SKIP_RETURN_CODE 77
                       TIMEOUT 60 FIXTURES_REQUIRED hosts_shm)
  add_test(NAME hosts.down_${count} COMMAND ${moe_ep_hosts_script} down ${set_${count}})
  set_tests_properties(hosts.down_${count} PROPERTIES LABELS hosts FIXTURES_CLEANUP hosts_${count} TIMEOUT 60
                       FIXTURES_REQUIRED hosts_shm)
endforeach()

# moe_ep_hosts_test(NAME HOSTS PER_HOST COMMAND...): COMMAND as an MPI job across the pretend hosts.
function(moe_ep_hosts_test name hosts per_host)
  set(count 2)
  if(hosts GREATER 2)
    set(count 4)
  endif()
  add_test(NAME hosts.${name} COMMAND ${moe_ep_hosts_dir}/run_on_hosts.sh ${set_${count}} ${hosts} ${per_host} 240 ${ARGN})
  set_tests_properties(hosts.${name} PROPERTIES LABELS hosts TIMEOUT 300 FIXTURES_REQUIRED "hosts_${count};hosts_shm"
                       SKIP_RETURN_CODE 77 ENVIRONMENT "${moe_ep_hosts_env}")
endfunction()

# Every mode, verified bit for bit against the tool's reference, on 2 hosts x 2 ranks (hybrid: a
# node per host), 2 x 1 and 4 x 1 (one rank per host: every exchange crosses hosts).
set(moe_ep_hosts_shape --tokens 16 --hidden 256 --experts 16 --topk 4 --iters 1)
set(moe_ep_hosts_modes v2 v2_expand v2_fp8 v2_direct v1 v1_low_latency v1_low_latency_logfmt v1_low_latency_nvfp4)
set(mode_v2)
set(mode_v2_expand --expand --alignment 16)
set(mode_v2_fp8 --fp8)
set(mode_v2_direct --no-hybrid --fp8)
set(mode_v1 --api v1)
set(mode_v1_low_latency --api v1 --low-latency --fp8)
set(mode_v1_low_latency_logfmt --api v1 --low-latency --logfmt)
set(mode_v1_low_latency_nvfp4 --api v1 --low-latency --nvfp4)
foreach(layout 2x2 2x1 4x1)
  string(REPLACE "x" ";" layout_parts ${layout})
  list(GET layout_parts 0 hosts)
  list(GET layout_parts 1 per_host)
  foreach(mode ${moe_ep_hosts_modes})
    moe_ep_hosts_test(run_${layout}_${mode} ${hosts} ${per_host}
                      $<TARGET_FILE:moe-ep> run --transport mpi ${moe_ep_hosts_shape} ${mode_${mode}})
  endforeach()
  # The MPI suite (property cases against the dense reference and the in-process transport, the
  # dispatcher's normal/low-latency sequence of both generations, V1 across nodes, disagreements).
  moe_ep_hosts_test(mpi_suite_${layout} ${hosts} ${per_host} $<TARGET_FILE:mpi_test>)
endforeach()

# Refusals, naming the hosts: a logical node that spans hosts; the host transport across hosts;
# ranks per node that does not divide a host's ranks; processes of one node that MPI reaches but
# that cannot map each other's memory (each rank in its own pid namespace; MPI over TCP alone,
# since Open MPI's own shared memory needs one pid namespace too). Every rank refuses alike, and
# mpirun ends the job once the first one exits, maybe before a given rank printed: any rank's
# line counts.
moe_ep_hosts_test(refuse_node_across_hosts 2 1 $<TARGET_FILE:moe-ep> run --transport mpi --ranks-per-node 2 ${moe_ep_hosts_shape})
moe_ep_hosts_test(refuse_host_transport 2 2 $<TARGET_FILE:moe-ep> run --transport host ${moe_ep_hosts_shape})
moe_ep_hosts_test(refuse_uneven_nodes 2 3 $<TARGET_FILE:moe-ep> run --transport mpi --ranks-per-node 2 --experts 12 --topk 4 --tokens 16 --hidden 256 --iters 1)
moe_ep_hosts_test(refuse_unshared_memory 2 2 --mca btl tcp,self unshare --pid --fork --mount-proc
                  $<TARGET_FILE:moe-ep> run --transport mpi ${moe_ep_hosts_shape})
set_tests_properties(hosts.refuse_node_across_hosts PROPERTIES PASS_REGULAR_EXPRESSION
  "moe-ep: \\[rank [0-9]+\\] mpi::make_group: node 0 \\(ranks 0..1\\) spans two hosts: rank 0 runs on host 'moeep-${set_2}-h0' \\(ranks \\[0\\]\\), rank 1 on host 'moeep-${set_2}-h1' \\(ranks \\[1\\]\\)")
set_tests_properties(hosts.refuse_host_transport PROPERTIES PASS_REGULAR_EXPRESSION
  "moe-ep: \\[rank [0-9]+\\] host::make_group: the processes run on 2 hosts \\(host moeep-${set_2}-h0 \\(boot [^)]*\\) runs ranks \\[0, 1\\]; host moeep-${set_2}-h1 \\(boot [^)]*\\) runs ranks \\[2, 3\\]\\)")
set_tests_properties(hosts.refuse_uneven_nodes PROPERTIES PASS_REGULAR_EXPRESSION
  "moe-ep: \\[rank [0-9]+\\] mpi::make_group: node 1 \\(ranks 2..3\\) spans two hosts: rank 2 runs on host 'moeep-${set_2}-h0' \\(ranks \\[0, 1, 2\\]\\), rank 3 on host 'moeep-${set_2}-h1' \\(ranks \\[3, 4, 5\\]\\)")
set_tests_properties(hosts.refuse_unshared_memory PROPERTIES PASS_REGULAR_EXPRESSION
  "moe-ep: \\[rank [0-9]+\\] mpi::make_group: on host 'moeep-${set_2}-h0' \\(ranks \\[0, 1\\]\\), ranks 0 and 1 of node 0 run in different pid namespaces")
foreach(refusal refuse_node_across_hosts refuse_host_transport refuse_uneven_nodes refuse_unshared_memory)
  set_tests_properties(hosts.${refusal} PROPERTIES SKIP_REGULAR_EXPRESSION "^SKIPPED: ")
endforeach()

# Failures across hosts: a rank killed, stopped, gone without a word, or never arriving, on the
# first host (rank 1) or the second (rank 2) of 2 x 2: every other rank on every host fails within
# the timeout (4 s), naming it alone (failure_check.sh).
foreach(mode kill stop exit absent)
  foreach(victim 1 2)
    add_test(NAME hosts.failure_${mode}_rank${victim} COMMAND ${moe_ep_hosts_dir}/failure_check.sh ${set_2} 2 2 ${mode}
             ${victim} $<TARGET_FILE:mpi_failure_probe>)
    set_tests_properties(hosts.failure_${mode}_rank${victim} PROPERTIES LABELS hosts TIMEOUT 300
                         FIXTURES_REQUIRED "hosts_2;hosts_shm" SKIP_RETURN_CODE 77
                         ENVIRONMENT "${MOE_EP_MPI_ENV};MOE_EP_TIMEOUT_SECS=4")
  endforeach()
endforeach()
# A rank stopped in the middle of the tool's run loop, on either host: every other rank names it,
# also those that waited for a live rank waiting for it. A rank killed there in V1 low-latency
# mode (node peers' slots and slabs read in place, other nodes' rows as messages): every other rank
# names it in a message that starts with the operation, without waiting for the timeout (60 s)
# (tool_failure_check.sh).
foreach(victim 1 2)
  add_test(NAME hosts.stopped_rank${victim} COMMAND ${moe_ep_hosts_dir}/tool_failure_check.sh ${set_2} 2 2 ${victim} stop
           $<TARGET_FILE:moe-ep> --tokens 32 --hidden 256)
  add_test(NAME hosts.killed_rank${victim}_v1_low_latency COMMAND ${moe_ep_hosts_dir}/tool_failure_check.sh ${set_2} 2 2
           ${victim} kill $<TARGET_FILE:moe-ep> --tokens 32 --hidden 256 --api v1 --low-latency --fp8)
  foreach(name stopped_rank${victim} killed_rank${victim}_v1_low_latency)
    set_tests_properties(hosts.${name} PROPERTIES LABELS hosts TIMEOUT 300 FIXTURES_REQUIRED "hosts_2;hosts_shm"
                         SKIP_RETURN_CODE 77 ENVIRONMENT "${MOE_EP_MPI_ENV}")
  endforeach()
endforeach()
