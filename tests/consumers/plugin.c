/* A shared object that links the static m40llm archive into itself (as a plugin or another
 * language's extension module would) and exports one function. */
#include "check.h"

#ifndef EXPECT_CUDA
#define EXPECT_CUDA -1
#endif

__attribute__((visibility("default"))) int consumer_plugin_check(void) {
  return consumer_check(EXPECT_CUDA);
}
