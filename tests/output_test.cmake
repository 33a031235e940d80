# collectives_add_output_test, the ctest helper of bench/ and examples/.

# A test that passes when the command exits with `status` and its output matches `regex`
# (PASS_REGULAR_EXPRESSION alone ignores the exit status; exit_status_test.sh prints
# "ok: exit status N:" only when the status is N). The command follows the regex; a target's
# binary is named $<TARGET_FILE:target>.
function(collectives_add_output_test name status regex)
  add_test(NAME ${name} COMMAND bash ${PROJECT_SOURCE_DIR}/bench/exit_status_test.sh ${status}
                                ${ARGN})
  set_tests_properties(${name} PROPERTIES PASS_REGULAR_EXPRESSION
                       "${regex}.*ok: exit status ${status}:")
endfunction()
