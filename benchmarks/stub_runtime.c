/* The trainer-runtime stand-in of benchmarks/stub_runtime.py in C, for benchmarks that run
 * thousands of pods on one machine: about 1 MB of memory per process where the Python one takes
 * about 15 (benchmarks/operator_scale.py --stub c builds it with the machine's cc).
 *
 * The same contract as stub_runtime.py: serves /metrics on
 * $PREEMPTIBLE_METRICS_HOST:$PREEMPTIBLE_METRICS_PORT, advances its step every
 * $STUB_STEP_SECONDS (whole seconds here), stops on SIGTERM or once the file
 * $STUB_CONTROL_DIR/$HOSTNAME.exit appears, writes the termination message to
 * $PREEMPTIBLE_TERMINATION_LOG and the wall time of its exit to $STUB_CONTROL_DIR/$HOSTNAME.exited,
 * and exits 75. The /metrics body is $STUB_METRICS_TEMPLATE with every "{step}" replaced by the
 * step (the benchmark renders the template from trainer_runtime.protocol's series names).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#define EXIT_PREEMPTED 75

static volatile sig_atomic_t stopped = 0;

static void on_term(int sig) {
    (void)sig;
    stopped = 1;
}

static const char *env_or(const char *name, const char *fallback) {
    const char *v = getenv(name);
    return (v && *v) ? v : fallback;
}

static double now(void) {
    struct timeval tv;
    gettimeofday(&tv, NULL);
    return tv.tv_sec + tv.tv_usec / 1e6;
}

/* The template with each "{step}" replaced: written into out (size cap), returns the length. */
static size_t render(const char *tmpl, long step, char *out, size_t cap) {
    size_t n = 0;
    char num[32];
    int len = snprintf(num, sizeof num, "%ld.0", step);
    for (const char *p = tmpl; *p && n + 32 < cap;) {
        if (strncmp(p, "{step}", 6) == 0) {
            memcpy(out + n, num, (size_t)len);
            n += (size_t)len;
            p += 6;
        } else {
            out[n++] = *p++;
        }
    }
    return n;
}

static void serve(int listener, const char *tmpl, long step) {
    int fd = accept(listener, NULL, NULL);
    if (fd < 0) return;
    struct timeval tv = {1, 0}; /* a scrape that sends nothing is dropped after 1 s */
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    char req[2048];
    size_t got = 0;
    while (got < sizeof req - 1) { /* the request head: up to the blank line */
        ssize_t r = recv(fd, req + got, sizeof req - 1 - got, 0);
        if (r <= 0) break;
        got += (size_t)r;
        req[got] = 0;
        if (strstr(req, "\r\n\r\n")) break;
    }
    static char body[8192];
    size_t blen = render(tmpl, step, body, sizeof body);
    char head[256];
    int hlen = snprintf(head, sizeof head,
                        "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
                        "Content-Length: %zu\r\nConnection: close\r\n\r\n",
                        blen);
    if (send(fd, head, (size_t)hlen, MSG_NOSIGNAL) == hlen) send(fd, body, blen, MSG_NOSIGNAL);
    close(fd);
}

static void write_file(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    if (!f) return;
    fputs(text, f);
    fclose(f);
}

int main(void) {
    const char *tmpl = env_or("STUB_METRICS_TEMPLATE", "");
    int step_seconds = atoi(env_or("STUB_STEP_SECONDS", "1"));
    if (step_seconds < 1) step_seconds = 1;
    const char *control = env_or("STUB_CONTROL_DIR", "");
    char host_buf[256];
    const char *pod = getenv("HOSTNAME");
    if (!pod || !*pod) {
        gethostname(host_buf, sizeof host_buf);
        pod = host_buf;
    }

    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_term;
    sigaction(SIGTERM, &sa, NULL);

    int listener = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in addr;
    memset(&addr, 0, sizeof addr);
    addr.sin_family = AF_INET;
    addr.sin_port = htons((unsigned short)atoi(env_or("PREEMPTIBLE_METRICS_PORT", "9090")));
    if (inet_pton(AF_INET, env_or("PREEMPTIBLE_METRICS_HOST", "127.0.0.1"), &addr.sin_addr) != 1
        || bind(listener, (struct sockaddr *)&addr, sizeof addr) != 0 || listen(listener, 16) != 0) {
        perror("stub_runtime: /metrics");
        return 1;
    }

    char trigger[4096] = "";
    if (*control) snprintf(trigger, sizeof trigger, "%s/%s.exit", control, pod);
    long step = 0;
    double next = now() + step_seconds;
    while (!stopped) {
        double left = next - now();
        if (left <= 0) {
            step++;
            next += step_seconds;
            if (*trigger && access(trigger, F_OK) == 0) break;
            continue;
        }
        struct pollfd pfd = {listener, POLLIN, 0};
        int ready = poll(&pfd, 1, (int)(left * 1000) + 1);
        if (ready > 0) serve(listener, tmpl, step);
        else if (ready < 0 && errno != EINTR) break;
    }

    char text[256];
    snprintf(text, sizeof text, "{\"reason\": \"preempted\", \"step\": %ld, \"complete\": false}", step);
    const char *log = getenv("PREEMPTIBLE_TERMINATION_LOG");
    if (log && *log) write_file(log, text);
    if (*control) {
        char path[4096], when[64];
        snprintf(path, sizeof path, "%s/%s.exited", control, pod);
        snprintf(when, sizeof when, "%.6f", now());
        write_file(path, when);
    }
    return EXIT_PREEMPTED;
}
