#include "ringserve/process.h"

#include <cerrno>
#include <csignal>
#include <fstream>
#include <iterator>
#include <string>

#include <sys/wait.h>

namespace ringserve {

bool is_process_alive(pid_t pid) {
  if (pid <= 0) return false;
  // EPERM means it exists but belongs to someone else: alive.
  if (::kill(pid, 0) != 0 && errno == ESRCH) return false;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  if (!stat) return true;  // no procfs: kill() is all we know
  const std::string line((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  // The command name may contain spaces and parentheses; the state follows the last ')'.
  const auto close = line.rfind(')');
  if (close == std::string::npos || close + 2 >= line.size()) return true;
  const char state = line[close + 2];
  return state != 'Z' && state != 'X' && state != 'x';
}

std::string describe_child_exit(pid_t pid) {
  siginfo_t info{};
  if (::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT) != 0 || info.si_pid != pid) {
    return "";
  }
  if (info.si_code == CLD_EXITED) return "exit code " + std::to_string(info.si_status);
  return "signal " + std::to_string(info.si_status);
}

}  // namespace ringserve
