/* session 22: print a native backtrace on SIGSEGV (LD_PRELOAD), so a crash inside an extension shows where */
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <unistd.h>
#include <dlfcn.h>
static void handler(int sig) {
  void *a[64]; int n = backtrace(a, 64);
  fprintf(stderr, "=== native backtrace (signal %d) ===\n", sig);
  for (int i = 0; i < n; i++) {
    Dl_info info;
    if (dladdr(a[i], &info) && info.dli_fname)
      fprintf(stderr, "#%d %s +0x%lx %s\n", i, info.dli_fname, (unsigned long)((char *)a[i] - (char *)info.dli_fbase),
              info.dli_sname ? info.dli_sname : "?");
  }
  signal(sig, SIG_DFL); raise(sig);
}
__attribute__((constructor)) static void init(void) { signal(SIGSEGV, handler); }
