#ifndef CONSUMER_CHECK_H
#define CONSUMER_CHECK_H
/* Runs the consumer check (check.c). expect_cuda: 1 or 0 to require m40llm_built_with_cuda() to
 * say so, -1 not to check. Returns 0 on success. */
int consumer_check(int expect_cuda);
#endif
