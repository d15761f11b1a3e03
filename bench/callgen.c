/* callgen: the load generator of the calls scenario (python -m bench --only calls), built on first use
 * by bench/callgen.py (gcc -O2). One thread, one epoll loop, blocking set-up.
 *
 *   callgen --port P [--path /mcp] --answer sse-ids|sse|json --connections C --sessions S
 *           --mode saturation|serial|rate [--duration SECONDS] [--warmup SECONDS]
 *           [--calls N] [--warmup-calls N] [--rate CALLS_PER_S] [--pids PID,PID...] [--upstream-pid PID]
 *
 * Set-up: C keep-alive connections to 127.0.0.1:P, connection i in session i % S. Each session is opened
 * on its first connection (POST initialize, then notifications/initialized, both waited for); every call
 * of a session carries its Mcp-Session-Id and a JSON-RPC id unique in the session (a counter per session).
 *
 * Modes (a call is one POST tools/call, answered by a whole HTTP response: status 200 and a body holding
 * "result"; anything else counts as an error):
 *   saturation  every connection keeps one call in flight for warmup + duration seconds; calls sent in
 *               the last `duration` seconds are counted and timed (send -> whole answer).
 *   serial      one call at a time on the first connection: `warmup-calls`, then `calls` timed.
 *   rate        open loop: call j is due at start + j / rate (a timerfd wakes the loop at the due time) and
 *               goes out on any idle connection; latency counts from the due time, not the send, so a
 *               target that falls behind is charged its queue (no coordinated omission). Calls due in
 *               the last `duration` seconds are counted. "late": calls sent more than 1 ms after their
 *               due time (this process or its timer late, or no connection idle); "stalled": calls that
 *               found no idle connection when due (the target behind the rate).
 * Afterwards every session is deleted (DELETE with its Mcp-Session-Id).
 *
 * Measured across the counted window: user+system CPU of the processes in --pids (the target) and of
 * --upstream-pid, from /proc/<pid>/stat, and this process's own (getrusage). Prints one JSON object:
 *   {"calls" (counted), "sent" and "answered" (all, the warm-up's too), "errors", "late", "stalled",
 *    "elapsed", "target_cpu", "upstream_cpu", "self_cpu", "error_example", "lat_us": [...]}
 * Loopback only.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#define IN_CAP (256 * 1024) /* one answer, head and body: the scenario's are under 1 KiB */
#define OUT_CAP 2048        /* one request: its head and a body of about 120 bytes */
#define SID_CAP 1024        /* an Mcp-Session-Id (visible ASCII; the proxy's own are 60-odd bytes) */
#define MAX_CONNS 1024
#define PROTOCOL "2025-11-25"

enum mode { SATURATION, SERIAL, RATE };

typedef struct {
    char id[SID_CAP];
    unsigned long long next_id;
} session_t;

typedef struct {
    int fd;
    session_t *session;
    int busy;         /* a call is in flight */
    int64_t timed_from; /* ns: the send (saturation, serial) or the due time (rate) */
    int counted;      /* the call falls in the counted window */
    char in[IN_CAP];
    size_t in_len;
} conn_t;

static int port;
static const char *path = "/mcp";
static const char *answer = "json";
static enum mode mode = SATURATION;
static int nconns = 16, nsessions = 4;
static double duration = 3.0, warmup = 0.5, rate = 500.0;
static long calls_wanted = 1000, warmup_calls = 100;
static int pids[64], npids;
static int upstream_pid;

static conn_t *conns;
static session_t *sessions;
static double *lat_us;
static size_t nlat, lat_cap;
static long errors, late, sent, answered_count;
static char error_example[512];

static void die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "callgen: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    exit(1);
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static double cpu_of(int pid) {
    char name[64], buf[2048];
    snprintf(name, sizeof name, "/proc/%d/stat", pid);
    FILE *f = fopen(name, "r");
    if (!f) return 0.0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    if (!p) return 0.0;
    /* after ")": state(3) ... utime is field 14, stime 15: the 12th and 13th after the state */
    unsigned long long utime = 0, stime = 0;
    int field = 2;
    for (char *tok = strtok(p + 1, " "); tok; tok = strtok(NULL, " ")) {
        field++;
        if (field == 14) utime = strtoull(tok, NULL, 10);
        if (field == 15) { stime = strtoull(tok, NULL, 10); break; }
    }
    return (double)(utime + stime) / (double)sysconf(_SC_CLK_TCK);
}

static double target_cpu(void) {
    double total = 0;
    for (int i = 0; i < npids; i++) total += cpu_of(pids[i]);
    return total;
}

static double self_cpu(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + ru.ru_stime.tv_sec + ru.ru_stime.tv_usec / 1e6;
}

static void record(double us) {
    if (nlat == lat_cap) {
        lat_cap = lat_cap ? lat_cap * 2 : 65536;
        lat_us = realloc(lat_us, lat_cap * sizeof *lat_us);
        if (!lat_us) die("out of memory");
    }
    lat_us[nlat++] = us;
}

static void note_error(const char *what, const char *data, size_t len) {
    errors++;
    if (!error_example[0]) {
        size_t n = len < 300 ? len : 300;
        snprintf(error_example, sizeof error_example, "%s: ", what);
        size_t at = strlen(error_example);
        for (size_t i = 0; i < n && at < sizeof error_example - 1; i++)
            error_example[at++] = isprint((unsigned char)data[i]) ? data[i] : '.';
        error_example[at] = 0;
    }
}

/* -- HTTP/1.1 answers ----------------------------------------------------------------------------- */

typedef struct {
    int status;
    size_t length; /* bytes of the whole answer in the buffer */
    const char *body; /* the body (de-chunked into `dechunked` when chunked) */
    size_t body_len;
    char sid[SID_CAP];
} answer_t;

static char dechunked[IN_CAP];

static const char *find(const char *hay, size_t len, const char *needle) {
    return memmem(hay, len, needle, strlen(needle));
}

/* 1: a whole answer is in buf (filled into *a); 0: not yet; -1: not an answer this parser takes. */
static int parse_answer(const char *buf, size_t len, answer_t *a) {
    const char *end = find(buf, len, "\r\n\r\n");
    if (!end) return len >= IN_CAP ? -1 : 0;
    size_t head_len = (size_t)(end - buf) + 4;
    if (len < 12 || memcmp(buf, "HTTP/1.1 ", 9) != 0) return -1;
    a->status = atoi(buf + 9);
    a->sid[0] = 0;
    long content_length = -1;
    int chunked = 0;
    const char *line = memchr(buf, '\n', head_len) + 1;
    while (line < end) {
        const char *eol = memchr(line, '\r', (size_t)(end + 2 - line));
        size_t n = (size_t)(eol - line);
        if (n > 15 && strncasecmp(line, "content-length:", 15) == 0) {
            content_length = strtol(line + 15, NULL, 10);
        } else if (n > 18 && strncasecmp(line, "transfer-encoding:", 18) == 0) {
            chunked = find(line, n, "chunked") != NULL;
        } else if (n > 15 && strncasecmp(line, "mcp-session-id:", 15) == 0) {
            const char *v = line + 15;
            while (*v == ' ') v++;
            size_t vn = (size_t)(eol - v);
            if (vn >= SID_CAP) return -1;
            memcpy(a->sid, v, vn);
            a->sid[vn] = 0;
        }
        line = eol + 2;
    }
    if (!chunked) {
        if (content_length < 0) {
            if (a->status == 204 || a->status == 304) content_length = 0;
            else return -1; /* an answer ended by closing: not from a keep-alive server */
        }
        if (len < head_len + (size_t)content_length) return 0;
        a->body = buf + head_len;
        a->body_len = (size_t)content_length;
        a->length = head_len + (size_t)content_length;
        return 1;
    }
    size_t at = head_len, out = 0;
    for (;;) {
        const char *eol = find(buf + at, len - at, "\r\n");
        if (!eol) return 0;
        unsigned long size = strtoul(buf + at, NULL, 16);
        at = (size_t)(eol - buf) + 2;
        if (size == 0) {
            /* trailers, if any, then the empty line */
            for (;;) {
                const char *t = find(buf + at, len - at, "\r\n");
                if (!t) return 0;
                size_t tn = (size_t)(t - (buf + at));
                at += tn + 2;
                if (tn == 0) break;
            }
            a->body = dechunked;
            a->body_len = out;
            a->length = at;
            return 1;
        }
        if (len < at + size + 2) return 0;
        if (out + size > sizeof dechunked) return -1;
        memcpy(dechunked + out, buf + at, size);
        out += size;
        at += size + 2;
    }
}

/* -- requests ------------------------------------------------------------------------------------- */

static size_t request(char *out, const char *method, const session_t *s, const char *body) {
    size_t body_len = body ? strlen(body) : 0;
    int n = snprintf(out, OUT_CAP,
                     "%s %s HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
                     "Accept: application/json, text/event-stream\r\n"
                     "Content-Type: application/json\r\n"
                     "%s%s%s"
                     "MCP-Protocol-Version: " PROTOCOL "\r\n"
                     "Content-Length: %zu\r\n\r\n%s",
                     method, path, port, s ? "Mcp-Session-Id: " : "", s ? s->id : "", s ? "\r\n" : "",
                     body_len, body ? body : "");
    if (n < 0 || n >= OUT_CAP) die("request too long");
    return (size_t)n;
}

static size_t call_request(char *out, session_t *s) {
    char body[512];
    snprintf(body, sizeof body,
             "{\"jsonrpc\":\"2.0\",\"id\":%llu,\"method\":\"tools/call\","
             "\"params\":{\"name\":\"bench\",\"arguments\":{\"answer\":\"%s\"}}}",
             s->next_id++, answer);
    return request(out, "POST", s, body);
}

static void send_all(int fd, const char *data, size_t len) {
    while (len) {
        ssize_t n = write(fd, data, len);
        if (n < 0) {
            if (errno == EINTR) continue;
            die("write: %s", strerror(errno));
        }
        data += n;
        len -= (size_t)n;
    }
}

/* Blocking: send `len` bytes, read the whole answer into a (buffer c->in). */
static void roundtrip(conn_t *c, const char *req, size_t len, answer_t *a) {
    send_all(c->fd, req, len);
    c->in_len = 0;
    for (;;) {
        ssize_t n = read(c->fd, c->in + c->in_len, IN_CAP - c->in_len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) die("set-up: connection closed (%s)", n < 0 ? strerror(errno) : "EOF");
        c->in_len += (size_t)n;
        int r = parse_answer(c->in, c->in_len, a);
        if (r < 0) die("set-up: unreadable answer: %.200s", c->in);
        if (r == 1) break;
    }
    c->in_len = 0;
}

static int connect_one(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) die("socket: %s", strerror(errno));
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) < 0) die("connect: %s", strerror(errno));
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return fd;
}

static void open_sessions(void) {
    char out[OUT_CAP];
    answer_t a;
    for (int s = 0; s < nsessions; s++) {
        conn_t *c = &conns[s];
        const char *init =
            "{\"jsonrpc\":\"2.0\",\"id\":0,\"method\":\"initialize\",\"params\":{\"protocolVersion\":\"" PROTOCOL
            "\",\"capabilities\":{},\"clientInfo\":{\"name\":\"callgen\",\"version\":\"1\"}}}";
        roundtrip(c, out, request(out, "POST", NULL, init), &a);
        if (a.status != 200 || !a.sid[0]) die("initialize: status %d, session id '%s'", a.status, a.sid);
        snprintf(sessions[s].id, SID_CAP, "%s", a.sid);
        sessions[s].next_id = 1;
        roundtrip(c, out,
                  request(out, "POST", &sessions[s], "{\"jsonrpc\":\"2.0\",\"method\":\"notifications/initialized\"}"),
                  &a);
        if (a.status != 202) die("notifications/initialized: status %d", a.status);
    }
}

static void delete_sessions(void) {
    char out[OUT_CAP];
    answer_t a;
    for (int s = 0; s < nsessions; s++) {
        roundtrip(&conns[s], out, request(out, "DELETE", &sessions[s], NULL), &a);
        if (a.status != 200 && a.status != 204) fprintf(stderr, "callgen: DELETE: status %d\n", a.status);
    }
}

/* -- the measured loop ------------------------------------------------------------------------------ */

static int epfd, timer_fd;
static int64_t t_start, t_count, t_end; /* counting: [t_count, t_end) */
static double cpu0, cpu1, up0, up1, self0, self1;
static int64_t counted_from, counted_to;
static int window_open, window_closed;
static long done_serial, sent_serial;
static unsigned long long due_index, stalled_index = ~0ULL;
static long stalled;
static int *idle;
static int nidle;

static void open_window(int64_t at) {
    if (window_open) return;
    window_open = 1;
    counted_from = at;
    cpu0 = target_cpu();
    up0 = upstream_pid ? cpu_of(upstream_pid) : 0;
    self0 = self_cpu();
}

static void close_window(int64_t at) {
    if (window_closed) return;
    window_closed = 1;
    counted_to = at;
    cpu1 = target_cpu();
    up1 = upstream_pid ? cpu_of(upstream_pid) : 0;
    self1 = self_cpu();
}

static void send_call(conn_t *c, int64_t timed_from, int counted) {
    char out[OUT_CAP];
    size_t n = call_request(out, c->session);
    send_all(c->fd, out, n); /* a few hundred bytes into an empty socket buffer: never partial */
    sent++;
    c->busy = 1;
    c->timed_from = timed_from;
    c->counted = counted;
}

/* A connection's whole answer arrived at `t`. */
static void answered(conn_t *c, const answer_t *a, int64_t t) {
    c->busy = 0;
    answered_count++;
    int ok = a->status == 200 && find(a->body, a->body_len, "\"result\"") != NULL;
    if (!ok) note_error("answer", c->in, a->length);
    if (c->counted && ok) record((double)(t - c->timed_from) / 1000.0);
}

static void arm_timer(int64_t at) {
    struct itimerspec its = {0};
    its.it_value.tv_sec = at / 1000000000;
    its.it_value.tv_nsec = at % 1000000000;
    if (its.it_value.tv_sec == 0 && its.it_value.tv_nsec == 0) its.it_value.tv_nsec = 1;
    timerfd_settime(timer_fd, TFD_TIMER_ABSTIME, &its, NULL);
}

/* rate mode: send every call due by `t` that an idle connection can take; arm the timer for the next. */
static void send_due(int64_t t) {
    for (;;) {
        int64_t due = t_start + (int64_t)((double)due_index * 1e9 / rate);
        if (due >= t_end) return;
        if (due > t) { arm_timer(due); return; }
        if (!nidle) { /* a connection's answer will send it: the target is behind the rate */
            if (due_index != stalled_index) stalled++;
            stalled_index = due_index;
            return;
        }
        conn_t *c = &conns[idle[--nidle]];
        if (t - due > 1000000) late++;
        send_call(c, due, due >= t_count);
        due_index++;
    }
}

/* After an answer on connection `i` at `t`: what this connection does next. */
static void next(int i, int64_t t) {
    conn_t *c = &conns[i];
    if (mode == SATURATION) {
        if (t < t_end) send_call(c, t, t >= t_count);
    } else if (mode == SERIAL) {
        done_serial++;
        if (done_serial == warmup_calls + calls_wanted) { close_window(t); return; }
        if (done_serial == warmup_calls) open_window(t);
        sent_serial++;
        send_call(c, t, done_serial >= warmup_calls);
    } else {
        idle[nidle++] = i;
        send_due(t);
    }
}

static int busy_count(void) {
    int n = 0;
    for (int i = 0; i < nconns; i++) n += conns[i].busy;
    return n;
}

static void run(void) {
    epfd = epoll_create1(0);
    timer_fd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK);
    struct epoll_event ev = {.events = EPOLLIN, .data.u32 = UINT32_MAX};
    epoll_ctl(epfd, EPOLL_CTL_ADD, timer_fd, &ev);
    for (int i = 0; i < nconns; i++) {
        struct epoll_event e = {.events = EPOLLIN, .data.u32 = (uint32_t)i};
        epoll_ctl(epfd, EPOLL_CTL_ADD, conns[i].fd, &e);
    }
    idle = calloc((size_t)nconns, sizeof *idle);
    t_start = now_ns();
    t_count = t_start + (int64_t)(warmup * 1e9);
    t_end = t_count + (int64_t)(duration * 1e9);
    if (mode == SATURATION) {
        for (int i = 0; i < nconns; i++) send_call(&conns[i], t_start, t_start >= t_count);
    } else if (mode == SERIAL) {
        if (warmup_calls == 0) open_window(t_start);
        sent_serial = 1;
        send_call(&conns[0], t_start, warmup_calls == 0);
        t_end = INT64_MAX;
    } else {
        for (int i = nconns - 1; i >= 0; i--) idle[nidle++] = i;
        send_due(t_start);
    }
    /* a bound on everything: the benchmark kills this process past its own deadline too */
    int64_t give_up = mode == SERIAL ? t_start + (int64_t)600e9 : t_end + (int64_t)30e9;
    struct epoll_event events[64];
    for (;;) {
        int64_t t = now_ns();
        if (mode != SERIAL) {
            if (t >= t_count) open_window(t_count);
            if (t >= t_end) close_window(t_end);
        }
        if (mode == SERIAL ? window_closed : (t >= t_end && busy_count() == 0)) break;
        if (t > give_up) die("calls still unanswered %d s after the end", (int)((t - t_end) / 1000000000));
        int timeout = 1; /* ms: the window's edges are read within a millisecond of when they pass */
        int n = epoll_wait(epfd, events, 64, timeout);
        if (n < 0 && errno != EINTR) die("epoll_wait: %s", strerror(errno));
        for (int k = 0; k < n; k++) {
            uint32_t i = events[k].data.u32;
            if (i == UINT32_MAX) {
                uint64_t expirations;
                ssize_t r = read(timer_fd, &expirations, sizeof expirations);
                (void)r;
                send_due(now_ns());
                continue;
            }
            conn_t *c = &conns[i];
            ssize_t got = read(c->fd, c->in + c->in_len, IN_CAP - c->in_len);
            if (got < 0 && (errno == EAGAIN || errno == EINTR)) continue;
            if (got <= 0) die("connection %u closed by the target (%s)", i, got < 0 ? strerror(errno) : "EOF");
            c->in_len += (size_t)got;
            answer_t a;
            int r = parse_answer(c->in, c->in_len, &a);
            if (r < 0) die("unreadable answer: %.300s", c->in);
            if (r == 0) continue;
            int64_t at = now_ns();
            if (a.length != c->in_len) die("bytes after an answer on connection %u", i);
            answered(c, &a, at);
            c->in_len = 0;
            next((int)i, at);
        }
    }
}

static void parse_pids(const char *text) {
    char *copy = strdup(text);
    for (char *tok = strtok(copy, ","); tok && npids < 64; tok = strtok(NULL, ",")) pids[npids++] = atoi(tok);
    free(copy);
}

int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        const char *k = argv[i];
        if (i + 1 >= argc) die("%s needs a value", k);
        const char *v = argv[++i];
        if (!strcmp(k, "--port")) port = atoi(v);
        else if (!strcmp(k, "--path")) path = v;
        else if (!strcmp(k, "--answer")) answer = v;
        else if (!strcmp(k, "--connections")) nconns = atoi(v);
        else if (!strcmp(k, "--sessions")) nsessions = atoi(v);
        else if (!strcmp(k, "--duration")) duration = atof(v);
        else if (!strcmp(k, "--warmup")) warmup = atof(v);
        else if (!strcmp(k, "--calls")) calls_wanted = atol(v);
        else if (!strcmp(k, "--warmup-calls")) warmup_calls = atol(v);
        else if (!strcmp(k, "--rate")) rate = atof(v);
        else if (!strcmp(k, "--pids")) parse_pids(v);
        else if (!strcmp(k, "--upstream-pid")) upstream_pid = atoi(v);
        else if (!strcmp(k, "--mode")) {
            if (!strcmp(v, "saturation")) mode = SATURATION;
            else if (!strcmp(v, "serial")) mode = SERIAL;
            else if (!strcmp(v, "rate")) mode = RATE;
            else die("unknown mode %s", v);
        } else die("unknown option %s", k);
    }
    if (port <= 0 || port > 65535) die("--port is required");
    if (mode == SERIAL) nconns = nsessions = 1;
    if (nconns < 1 || nconns > MAX_CONNS || nsessions < 1 || nsessions > nconns)
        die("need 1 <= sessions <= connections <= %d", MAX_CONNS);
    if (calls_wanted < 1 || warmup_calls < 0 || duration <= 0 || warmup < 0 || rate <= 0) die("bad numbers");
    conns = calloc((size_t)nconns, sizeof *conns);
    sessions = calloc((size_t)nsessions, sizeof *sessions);
    if (!conns || !sessions) die("out of memory");
    for (int i = 0; i < nconns; i++) {
        conns[i].fd = connect_one();
        conns[i].session = &sessions[i % nsessions];
    }
    open_sessions();
    run();
    delete_sessions();
    double elapsed = (double)(counted_to - counted_from) / 1e9;
    printf("{\"mode\":\"%s\",\"answer\":\"%s\",\"connections\":%d,\"sessions\":%d,\"calls\":%zu,"
           "\"sent\":%ld,\"answered\":%ld,\"errors\":%ld,\"late\":%ld,\"stalled\":%ld,\"elapsed\":%.6f,\"target_cpu\":%.4f,\"upstream_cpu\":%.4f,"
           "\"self_cpu\":%.4f,\"error_example\":\"",
           mode == SATURATION ? "saturation" : mode == SERIAL ? "serial" : "rate", answer, nconns, nsessions,
           nlat, sent, answered_count, errors, late, stalled, elapsed, cpu1 - cpu0, up1 - up0, self1 - self0);
    for (const char *p = error_example; *p; p++) {
        if (*p == '"' || *p == '\\') putchar('\\');
        putchar(*p);
    }
    printf("\",\"lat_us\":[");
    for (size_t i = 0; i < nlat; i++) printf(i ? ",%.1f" : "%.1f", lat_us[i]);
    printf("]}\n");
    return 0;
}
