/* Loads the plugin shared object at run time and runs its check: the program itself does not
 * link m40llm. Usage: plugin_main /path/to/libconsumer_plugin.so */
#include <dlfcn.h>
#include <stdio.h>

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s PLUGIN.so\n", argv[0]);
    return 2;
  }
  void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    fprintf(stderr, "plugin_main: dlopen: %s\n", dlerror());
    return 1;
  }
  int (*check)(void);
  *(void **)&check = dlsym(h, "consumer_plugin_check");
  if (!check) {
    fprintf(stderr, "plugin_main: dlsym: %s\n", dlerror());
    return 1;
  }
  int rc = check();
  dlclose(h);
  return rc == 0 ? 0 : 1;
}
