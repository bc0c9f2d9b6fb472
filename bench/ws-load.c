/* ws-load.c -- the WebSocket load generator of `make bench-websockets`
 * (bench/websockets.lisp compiles it with gcc): one thread, epoll, many
 * client WebSockets on 127.0.0.1.
 *
 *   ws-load hold PORT PATH N        open N WebSockets, print "OPEN <open> <failed>",
 *                                   keep them idle until standard input ends
 *   ws-load echo PORT PATH N SECS   N WebSockets each send a 32-octet text, wait
 *                                   for its echo, again: "ECHO <round trips/s> <failed>"
 *   ws-load broadcast PORT PATH N   N WebSockets; the first sends "go"; the time until
 *                                   every one got a frame: "BROADCAST <ms> <got>/<N>"
 *
 * At most 256 handshakes are in flight at once.  Every wait is bounded. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

enum { CONNECTING, HANDSHAKE, OPEN, DEAD };
struct conn { int fd, state, got, fill; char buf[8192]; };

static struct conn *conns;
static int n, port, epfd, opened, failed, inflight;
static const char *path;

static double now_ms(void) {
  struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static void start(int i) {
  struct conn *c = &conns[i];
  struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(port) };
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  c->fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
  if (c->fd < 0) { c->state = DEAD; failed++; return; }
  int one = 1; setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  connect(c->fd, (struct sockaddr *)&a, sizeof a);
  c->state = CONNECTING; c->fill = 0; c->got = 0; inflight++;
  struct epoll_event ev = { .events = EPOLLIN | EPOLLOUT, .data.u32 = i };
  epoll_ctl(epfd, EPOLL_CTL_ADD, c->fd, &ev);
}

static void kill_conn(int i) {
  struct conn *c = &conns[i];
  if (c->state == DEAD) return;
  if (c->state != OPEN) { inflight--; failed++; } else opened--;
  close(c->fd); c->state = DEAD;
}

static int send_all(int fd, const void *p, size_t len) {
  const char *s = p;
  while (len) {
    ssize_t k = send(fd, s, len, MSG_NOSIGNAL);
    if (k < 0) { if (errno == EAGAIN) { struct pollfd q = { fd, POLLOUT, 0 }; poll(&q, 1, 5000); continue; } return -1; }
    s += k; len -= k;
  }
  return 0;
}

static int send_text(int fd, const char *text) {
  unsigned char f[256]; size_t len = strlen(text);
  unsigned char mask[4] = { 1, 2, 3, 4 };
  f[0] = 0x81; f[1] = 0x80 | len; memcpy(f + 2, mask, 4);
  for (size_t i = 0; i < len; i++) f[6 + i] = text[i] ^ mask[i % 4];
  return send_all(fd, f, 6 + len);
}

/* Frames whole in c->buf: count them, keep the rest.  Returns frames read. */
static int take_frames(struct conn *c) {
  int frames = 0, at = 0;
  for (;;) {
    int left = c->fill - at;
    if (left < 2) break;
    unsigned char *b = (unsigned char *)c->buf + at;
    size_t len = b[1] & 127, head = 2;
    if (len == 126) { if (left < 4) break; len = (b[2] << 8) | b[3]; head = 4; }
    else if (len == 127) { if (left < 10) break; len = 0; for (int k = 2; k < 10; k++) len = (len << 8) | b[k]; head = 10; }
    if ((size_t)left < head + len) { if (head + len > sizeof c->buf) { c->fill = 0; return -1; } break; }
    at += head + len; frames++;
  }
  memmove(c->buf, c->buf + at, c->fill - at); c->fill -= at;
  return frames;
}

static const char *mode;
static int echo_rounds;

static void on_event(int i, unsigned events) {
  struct conn *c = &conns[i];
  if (c->state == DEAD) return;
  if (events & (EPOLLERR | EPOLLHUP)) { kill_conn(i); return; }
  if (c->state == CONNECTING && (events & EPOLLOUT)) {
    char req[512];
    int len = snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
                       "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                       "Sec-WebSocket-Version: 13\r\n\r\n", path);
    if (send_all(c->fd, req, len) < 0) { kill_conn(i); return; }
    c->state = HANDSHAKE;
    struct epoll_event ev = { .events = EPOLLIN, .data.u32 = i };
    epoll_ctl(epfd, EPOLL_CTL_MOD, c->fd, &ev);
    return;
  }
  if (!(events & EPOLLIN)) return;
  for (;;) {
    ssize_t k = recv(c->fd, c->buf + c->fill, sizeof c->buf - c->fill, 0);
    if (k == 0 || (k < 0 && errno != EAGAIN)) { kill_conn(i); return; }
    if (k < 0) return;
    c->fill += k;
    if (c->state == HANDSHAKE) {
      char *end = memmem(c->buf, c->fill, "\r\n\r\n", 4);
      if (!end) continue;
      if (strncmp(c->buf, "HTTP/1.1 101", 12)) { kill_conn(i); return; }
      int head = end + 4 - c->buf;
      memmove(c->buf, c->buf + head, c->fill - head); c->fill -= head;
      c->state = OPEN; inflight--; opened++;
    }
    int frames = take_frames(c);
    if (frames < 0) { kill_conn(i); return; }
    if (frames > 0) {
      c->got += frames;
      if (!strcmp(mode, "echo")) {
        echo_rounds += frames;
        if (send_text(c->fd, "0123456789abcdef0123456789abcdef") < 0) { kill_conn(i); return; }
      }
    }
  }
}

static void loop_for(double ms, int (*done)(void)) {
  struct epoll_event evs[256];
  double end = now_ms() + ms;
  while (now_ms() < end && !(done && done())) {
    int k = epoll_wait(epfd, evs, 256, 50);
    for (int j = 0; j < k; j++) on_event(evs[j].data.u32, evs[j].events);
  }
}

static int next_to_start;
static int all_settled(void) { return next_to_start == n && inflight == 0; }

static void open_all(void) {
  double end = now_ms() + 120000;
  while (now_ms() < end && !all_settled()) {
    while (next_to_start < n && inflight < 256) start(next_to_start++);
    loop_for(20, NULL);
  }
}

static int all_got(void) {
  for (int i = 0; i < n; i++) if (conns[i].state == OPEN && conns[i].got == 0) return 0;
  return 1;
}

int main(int argc, char **argv) {
  if (argc < 5) { fprintf(stderr, "usage: ws-load hold|echo|broadcast PORT PATH N [SECONDS]\n"); return 2; }
  mode = argv[1]; port = atoi(argv[2]); path = argv[3]; n = atoi(argv[4]);
  int seconds = argc > 5 ? atoi(argv[5]) : 5;
  struct rlimit r; getrlimit(RLIMIT_NOFILE, &r); r.rlim_cur = r.rlim_max; setrlimit(RLIMIT_NOFILE, &r);
  conns = calloc(n, sizeof *conns);
  epfd = epoll_create1(0);
  open_all();
  if (!strcmp(mode, "hold")) {
    printf("OPEN %d %d\n", opened, failed); fflush(stdout);
    char line[64];
    while (fgets(line, sizeof line, stdin)) ;
  } else if (!strcmp(mode, "echo")) {
    for (int i = 0; i < n; i++)
      if (conns[i].state == OPEN && send_text(conns[i].fd, "0123456789abcdef0123456789abcdef") < 0) kill_conn(i);
    loop_for(500, NULL);                /* warm up */
    echo_rounds = 0;
    double t0 = now_ms();
    loop_for(seconds * 1000.0, NULL);
    printf("ECHO %.0f %d\n", echo_rounds * 1000.0 / (now_ms() - t0), failed);
  } else {
    loop_for(500, NULL);                /* whatever the server says on open */
    for (int i = 0; i < n; i++) conns[i].got = 0;
    double t0 = now_ms();
    send_text(conns[0].fd, "go");
    loop_for(60000, all_got);
    int got = 0;
    for (int i = 0; i < n; i++) if (conns[i].state == OPEN && conns[i].got) got++;
    printf("BROADCAST %.1f %d/%d\n", now_ms() - t0, got, n);
  }
  fflush(stdout);
  return 0;
}
