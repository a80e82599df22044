/* The stand-in engine of bench/bench_slurm_scale.py: `scale_engine HOST PORT` answers every HTTP
 * request with 200 and "{}" (the supervisor's /health_generate probe), one connection at a time;
 * `POST /exit` makes it exit with code 1 (a crash). A few hundred KiB a process, so 512 of them fit
 * beside the devcluster on a shared 2-core machine: the bench measures the head node's cost per
 * engine, not the engine. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static const char OK[] = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
                         "Connection: close\r\n\r\n{}";

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s HOST PORT\n", argv[0]);
        return 2;
    }
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons(atoi(argv[2]))};
    int one = 1, server = socket(AF_INET, SOCK_STREAM, 0);
    if (inet_pton(AF_INET, argv[1], &addr.sin_addr) != 1 || server < 0 ||
        setsockopt(server, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) < 0 ||
        bind(server, (struct sockaddr *)&addr, sizeof addr) < 0 || listen(server, 64) < 0) {
        perror("scale_engine");
        return 1;
    }
    for (;;) {
        int conn = accept(server, NULL, NULL);
        if (conn < 0)
            continue;
        char request[4096];
        size_t got = 0;
        ssize_t n;
        while (got < sizeof request - 1 && (n = read(conn, request + got, sizeof request - 1 - got)) > 0) {
            got += (size_t)n;
            request[got] = 0;
            if (strstr(request, "\r\n\r\n"))
                break;
        }
        request[got] = 0;
        ssize_t sent = write(conn, OK, sizeof OK - 1);
        close(conn);
        if (sent > 0 && strncmp(request, "POST /exit", 10) == 0)
            return 1;
    }
}
