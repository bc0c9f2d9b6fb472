;;;; syscalls.lisp -- the few Linux system calls Gallop needs, through SB-ALIEN.
;;;;
;;;; Every call that can block (epoll_wait, poll, read, send, accept4) can
;;;; return -1/EINTR at any time: SBCL stops threads for GC with a signal, and
;;;; the kernel never restarts epoll_wait or poll.  The wrappers below retry on
;;;; EINTR where that is right (never for close), and return -1 with the errno as a second value
;;;; otherwise, so callers can tell EAGAIN from a real failure without consing.
;;;;
;;;; struct epoll_event is PACKED on x86-64: 12 bytes, events (u32) at offset 0
;;;; and data (u64) at offset 4; on arm64 it is aligned: 16 bytes, data at 8.
;;;; It is read and written as raw bytes through SAP-REF at the offsets below,
;;;; which refuse to compile for any other architecture.

(in-package #:gallop.core)

(defconstant +eintr+ 4)
(defconstant +eagain+ 11)
(defconstant +emfile+ 24)
(defconstant +enfile+ 23)
(defconstant +epipe+ 32)
(defconstant +econnreset+ 104)

(defconstant +epollin+ #x001)
(defconstant +epollout+ #x004)
(defconstant +epollerr+ #x008)
(defconstant +epollhup+ #x010)
(defconstant +epollrdhup+ #x2000)
(defconstant +epollet+ #x80000000)
(defconstant +epolloneshot+ #x40000000)

(defconstant +epoll-ctl-add+ 1)
(defconstant +epoll-ctl-del+ 2)
(defconstant +epoll-ctl-mod+ 3)

#-(or x86-64 arm64)
(eval-when (:compile-toplevel :load-toplevel :execute)
  (error "Gallop knows the layout of struct epoll_event on x86-64 and arm64 only."))

(defconstant +epoll-event-size+ #+x86-64 12 #-x86-64 16
  "sizeof (struct epoll_event): packed on x86-64, aligned on arm64.")

(defconstant +epoll-event-data+ #+x86-64 4 #-x86-64 8
  "The offset of the data (u64) in struct epoll_event.")

(defconstant +o-nonblock+ #o4000)
(defconstant +o-cloexec+ #o2000000)
(defconstant +sock-nonblock+ #o4000)
(defconstant +sock-cloexec+ #o2000000)
(defconstant +efd-nonblock+ #o4000)
(defconstant +efd-cloexec+ #o2000000)
(defconstant +f-getfl+ 3)
(defconstant +f-setfl+ 4)
(defconstant +f-dupfd-cloexec+ 1030)
(defconstant +msg-nosignal+ #x4000)
(defconstant +msg-peek+ #x2)
(defconstant +msg-dontwait+ #x40)
(defconstant +shut-rd+ 0)
(defconstant +shut-wr+ 1)
(defconstant +shut-rdwr+ 2)
(defconstant +pollin+ #x001)
(defconstant +pollout+ #x004)
(defconstant +rlimit-nofile+ 7)

(deftype octets () '(simple-array (unsigned-byte 8) (*)))
(deftype fd () '(integer -1 #.(1- (expt 2 31))))

;;; time
;;;
;;; Deadlines need milliseconds, not nanoseconds, and are read a few times per
;;; request, so they come from the coarse clocks: the kernel's tick, read
;;; from the vDSO without touching the hardware clock, several times cheaper
;;; than GET-INTERNAL-REAL-TIME (a precise read, then generic arithmetic).
;;; Their resolution, one tick (1 to 10 ms), is far below any timeout's.
;;; A request's duration (and the due time of GALLOP:AFTER's timers, which
;;; may be shorter than a tick) reads the precise clock, NOW-US: a tick is
;;; as long as the durations the metrics tell apart (doc/design.md,
;;; "Durations read the precise clock").

(defconstant +clock-monotonic+ 1)
(defconstant +clock-realtime-coarse+ 5)
(defconstant +clock-monotonic-coarse+ 6)

(declaim (inline clock-gettime now-ms now-us unix-seconds))
(defun clock-gettime (clock)
  "CLOCK (a clock_gettime clock id): its seconds and nanoseconds."
  (declare (optimize speed))
  (sb-alien:with-alien ((ts (sb-alien:array (sb-alien:signed 64) 2)))
    (sb-alien:alien-funcall
     (sb-alien:extern-alien "clock_gettime"
                            (function sb-alien:int sb-alien:int (* (sb-alien:array (sb-alien:signed 64) 2))))
     clock (sb-alien:addr ts))
    (values (the (integer 0 #.(expt 2 40)) (sb-alien:deref ts 0))
            (the (integer 0 999999999) (sb-alien:deref ts 1)))))

(defun now-ms ()
  "A monotonic clock in milliseconds (coarse: one kernel tick)."
  (multiple-value-bind (seconds nanoseconds) (clock-gettime +clock-monotonic-coarse+)
    (+ (* seconds 1000) (floor nanoseconds 1000000))))

(defun now-us ()
  "The monotonic clock in microseconds (precise: CLOCK_MONOTONIC, from the
vDSO, no allocation)."
  (multiple-value-bind (seconds nanoseconds) (clock-gettime +clock-monotonic+)
    (+ (* seconds 1000000) (floor nanoseconds 1000))))

(defun unix-seconds ()
  "Seconds since 1970 (coarse: may lag the precise clock by a tick)."
  (values (clock-gettime +clock-realtime-coarse+)))

(declaim (inline %errno))
(defun %errno () (sb-alien:get-errno))

(sb-alien:define-alien-routine ("epoll_create1" %epoll-create1) sb-alien:int
  (flags sb-alien:int))
(sb-alien:define-alien-routine ("epoll_ctl" %epoll-ctl) sb-alien:int
  (epfd sb-alien:int) (op sb-alien:int) (fd sb-alien:int)
  (event sb-sys:system-area-pointer))
(sb-alien:define-alien-routine ("epoll_wait" %epoll-wait) sb-alien:int
  (epfd sb-alien:int) (events sb-sys:system-area-pointer)
  (maxevents sb-alien:int) (timeout sb-alien:int))
(sb-alien:define-alien-routine ("accept4" %accept4) sb-alien:int
  (fd sb-alien:int) (addr sb-sys:system-area-pointer)
  (addrlen sb-sys:system-area-pointer) (flags sb-alien:int))
;;; recv(2), not read(2): on a socket read(2) goes through the VFS layer
;;; first (file position lock check, permission and fsnotify hooks), which
;;; recv skips; nginx reads its sockets the same way.
(sb-alien:define-alien-routine ("recv" %recv) sb-alien:long
  (fd sb-alien:int) (buf sb-sys:system-area-pointer) (count sb-alien:unsigned-long)
  (flags sb-alien:int))
(sb-alien:define-alien-routine ("send" %send) sb-alien:long
  (fd sb-alien:int) (buf sb-sys:system-area-pointer) (count sb-alien:unsigned-long)
  (flags sb-alien:int))
(sb-alien:define-alien-routine ("read" %read) sb-alien:long
  (fd sb-alien:int) (buf sb-sys:system-area-pointer) (count sb-alien:unsigned-long))
(sb-alien:define-alien-routine ("write" %write) sb-alien:long
  (fd sb-alien:int) (buf sb-sys:system-area-pointer) (count sb-alien:unsigned-long))
(sb-alien:define-alien-routine ("malloc_trim" %malloc-trim) sb-alien:int (pad sb-alien:unsigned-long))
(sb-alien:define-alien-routine ("pread" %pread-file) sb-alien:long
  (fd sb-alien:int) (buf sb-sys:system-area-pointer) (count sb-alien:unsigned-long)
  (offset sb-alien:long))
(sb-alien:define-alien-routine ("open" %open-file) sb-alien:int
  (path sb-alien:c-string) (flags sb-alien:int) (mode sb-alien:int))
(sb-alien:define-alien-routine ("unlink" %unlink) sb-alien:int (path sb-alien:c-string))
(sb-alien:define-alien-routine ("sendfile" %sendfile) sb-alien:long
  (out-fd sb-alien:int) (in-fd sb-alien:int) (offset sb-sys:system-area-pointer)
  (count sb-alien:unsigned-long))
(sb-alien:define-alien-routine ("close" %close) sb-alien:int (fd sb-alien:int))
(sb-alien:define-alien-routine ("shutdown" %shutdown) sb-alien:int
  (fd sb-alien:int) (how sb-alien:int))
(sb-alien:define-alien-routine ("poll" %poll) sb-alien:int
  (fds sb-sys:system-area-pointer) (nfds sb-alien:unsigned-long) (timeout sb-alien:int))
(sb-alien:define-alien-routine ("eventfd" %eventfd) sb-alien:int
  (initval sb-alien:unsigned-int) (flags sb-alien:int))
(sb-alien:define-alien-routine ("fcntl" %fcntl) sb-alien:int
  (fd sb-alien:int) (cmd sb-alien:int) (arg sb-alien:long))
(sb-alien:define-alien-routine ("getsockname" %getsockname) sb-alien:int
  (fd sb-alien:int) (addr sb-sys:system-area-pointer) (addrlen sb-sys:system-area-pointer))
(sb-alien:define-alien-routine ("setsockopt" %setsockopt) sb-alien:int
  (fd sb-alien:int) (level sb-alien:int) (name sb-alien:int)
  (value sb-sys:system-area-pointer) (length sb-alien:unsigned-int))
(sb-alien:define-alien-routine ("getrlimit" %getrlimit) sb-alien:int
  (resource sb-alien:int) (rlim sb-sys:system-area-pointer))
(sb-alien:define-alien-routine ("setrlimit" %setrlimit) sb-alien:int
  (resource sb-alien:int) (rlim sb-sys:system-area-pointer))

;;; epoll

(defun epoll-create ()
  (let ((fd (%epoll-create1 +sock-cloexec+)))
    (when (< fd 0) (error "epoll_create1 failed: errno ~D" (%errno)))
    fd))

(defun epoll-ctl (epfd op fd events data)
  "Add, modify or delete FD in the epoll set EPFD.  DATA is the 64-bit value
handed back by epoll_wait.  Returns T on success, NIL and the errno on failure."
  (declare (type fd epfd fd) (type (unsigned-byte 32) events)
           (type (unsigned-byte 64) data))
  (sb-alien:with-alien ((ev (array (sb-alien:unsigned 8) 16)))
    (let ((sap (sb-alien:alien-sap ev)))
      (setf (sb-sys:sap-ref-32 sap 0) events
            (sb-sys:sap-ref-64 sap +epoll-event-data+) data)
      (if (zerop (%epoll-ctl epfd op fd sap))
          t
          (values nil (%errno))))))

(defun make-event-buffer (count)
  "A foreign buffer for COUNT packed epoll events; free it with FREE-EVENT-BUFFER."
  (sb-alien:alien-sap (sb-alien:make-alien (sb-alien:unsigned 8)
                                           (* count +epoll-event-size+))))

(defun free-event-buffer (sap)
  (sb-alien:free-alien (sb-alien:sap-alien sap (* (sb-alien:unsigned 8)))))

(declaim (inline event-flags event-data))
(defun event-flags (sap index)
  (sb-sys:sap-ref-32 sap (* index +epoll-event-size+)))
(defun event-data (sap index)
  (sb-sys:sap-ref-64 sap (+ +epoll-event-data+ (* index +epoll-event-size+))))

(defun epoll-wait (epfd sap max timeout-ms)
  "Wait for up to MAX events.  Returns the count, 0 on timeout or EINTR."
  (let ((n (%epoll-wait epfd sap max timeout-ms)))
    (cond ((>= n 0) n)
          ((= (%errno) +eintr+) 0)
          (t (error "epoll_wait failed: errno ~D" (%errno))))))

;;; file descriptors

(defun set-nonblocking (fd)
  "Put FD in non-blocking mode."
  (let ((flags (%fcntl fd +f-getfl+ 0)))
    (when (< flags 0) (error "fcntl(F_GETFL) failed: errno ~D" (%errno)))
    (unless (logtest flags +o-nonblock+)
      (%fcntl fd +f-setfl+ (logior flags +o-nonblock+)))
    fd))

(defun close-fd (fd)
  "close(2) FD once.  Never retried, not even on EINTR: Linux frees the fd
number whatever close returns, and another thread may already have it."
  (%close fd)
  (values))

(defun dup-fd (fd)
  "A new fd (close-on-exec) for the file open on FD, or -1 (out of fds)."
  (%fcntl fd +f-dupfd-cloexec+ 0))

(defconstant +ipproto-tcp+ 6)
(defconstant +tcp-notsent-lowat+ 25)

(defconstant +tcp-nodelay+ 1)

(sb-alien:define-alien-routine ("getsockopt" %getsockopt) sb-alien:int
  (fd sb-alien:int) (level sb-alien:int) (name sb-alien:int)
  (value sb-sys:system-area-pointer) (length sb-sys:system-area-pointer))

(defconstant +tcp-info+ 11)
(defconstant +tcpi-bytes-acked-offset+ 120
  "Where struct tcp_info's tcpi_bytes_acked (Linux 4.1 on) is.")

(defun tcp-bytes-acked (fd)
  "Octets of output the peer's TCP has acknowledged on the socket FD, in all
\(TCP_INFO), or NIL.  A client whose receive buffer is full acknowledges
nothing more until it reads: this sees its reading, where a writable
socket is reported only once the kernel's unsent output fell well under
TCP_NOTSENT_LOWAT."
  (sb-alien:with-alien ((info (array (sb-alien:unsigned 8) 256))
                        (length (sb-alien:unsigned 32) 256))
    (let ((sap (sb-alien:alien-sap info)))
      (and (zerop (%getsockopt fd +ipproto-tcp+ +tcp-info+ sap
                               (sb-alien:alien-sap (sb-alien:addr length))))
           (>= length (+ 8 +tcpi-bytes-acked-offset+))
           (sb-sys:sap-ref-64 sap +tcpi-bytes-acked-offset+)))))

(defconstant +sol-socket+ 1)
(defconstant +so-linger+ 13)

(defun set-reset-on-close (fd)
  "Make close(2) of FD reset the connection (SO_LINGER on, 0 s) instead of
leaving the kernel to send what is unsent first: for a client that reads
nothing, that would keep its buffers until the kernel gives up, minutes
later (nginx's reset_timedout_connection)."
  (sb-alien:with-alien ((linger (array sb-alien:int 2)))
    (setf (sb-alien:deref linger 0) 1
          (sb-alien:deref linger 1) 0)
    (zerop (%setsockopt fd +sol-socket+ +so-linger+ (sb-alien:alien-sap linger) 8))))

(defun set-nodelay (fd)
  "Send small writes on FD at once (TCP_NODELAY): no Nagle wait for the
peer's acknowledgement, which a delayed ACK holds back 40 ms."
  (sb-alien:with-alien ((value sb-alien:int 1))
    (zerop (%setsockopt fd +ipproto-tcp+ +tcp-nodelay+
                        (sb-alien:alien-sap (sb-alien:addr value)) 4))))

(defun set-notsent-lowat (fd octets)
  "Let the kernel keep at most about OCTETS of FD's output not yet sent to the
peer (TCP_NOTSENT_LOWAT): past that, send(2) takes nothing more and epoll
reports the socket writable only once the peer has taken enough.  Sockets
accepted from a listening socket inherit it.  True if it was set."
  (sb-alien:with-alien ((value sb-alien:int octets))
    (zerop (%setsockopt fd +ipproto-tcp+ +tcp-notsent-lowat+
                        (sb-alien:alien-sap (sb-alien:addr value)) 4))))

(defun shutdown-fd (fd how)
  (%shutdown fd how))

(defconstant +pr-set-name+ 15)

(defun set-thread-os-name (name)
  "Give the calling thread NAME (its first 15 octets) where the kernel shows
threads: /proc/self/task/TID/comm, top -H, ps -L, perf.  SBCL names threads
for Lisp only; to the kernel every thread of the process is \"sbcl\"."
  (declare (type simple-string name))
  (sb-alien:alien-funcall
   (sb-alien:extern-alien "prctl" (function sb-alien:int sb-alien:int sb-alien:c-string))
   +pr-set-name+ name))

(defun make-eventfd ()
  (let ((fd (%eventfd 0 (logior +efd-nonblock+ +efd-cloexec+))))
    (when (< fd 0) (error "eventfd failed: errno ~D" (%errno)))
    fd))

;;; timerfd: the application timers' clock (timers.lisp)

(defconstant +tfd-nonblock+ #o4000)
(defconstant +tfd-cloexec+ #o2000000)
(defconstant +tfd-timer-abstime+ 1)

(sb-alien:define-alien-routine ("timerfd_create" %timerfd-create) sb-alien:int
  (clock sb-alien:int) (flags sb-alien:int))
(sb-alien:define-alien-routine ("timerfd_settime" %timerfd-settime) sb-alien:int
  (fd sb-alien:int) (flags sb-alien:int) (new sb-sys:system-area-pointer)
  (old sb-sys:system-area-pointer))

(defun make-timerfd ()
  "A non-blocking timerfd on CLOCK_MONOTONIC, not armed."
  (let ((fd (%timerfd-create +clock-monotonic+ (logior +tfd-nonblock+ +tfd-cloexec+))))
    (when (< fd 0) (error "timerfd_create failed: errno ~D" (%errno)))
    fd))

(defun set-timerfd (fd deadline-us)
  "Arm the timerfd FD to expire once at DEADLINE-US (CLOCK_MONOTONIC, µs);
one already past expires at once."
  (sb-alien:with-alien ((spec (array (sb-alien:signed 64) 4)))
    (multiple-value-bind (seconds us) (floor (max deadline-us 1) 1000000)
      (setf (sb-alien:deref spec 0) 0 (sb-alien:deref spec 1) 0 ; no interval
            (sb-alien:deref spec 2) seconds (sb-alien:deref spec 3) (* us 1000)))
    (%timerfd-settime fd +tfd-timer-abstime+ (sb-alien:alien-sap spec) (sb-sys:int-sap 0))))

(defun read-timerfd (fd)
  "Consume the timerfd FD's expirations, if any."
  (sb-alien:with-alien ((count (sb-alien:unsigned 64)))
    (%read fd (sb-alien:alien-sap (sb-alien:addr count)) 8)))

(defun signal-eventfd (fd)
  "Make the eventfd FD readable (it stays readable: nobody consumes it)."
  (sb-alien:with-alien ((one (sb-alien:unsigned 64) 1))
    (%write fd (sb-alien:alien-sap (sb-alien:addr one)) 8)))

(declaim (inline read-into send-from))
(defun read-into (fd buffer start end)
  "recv(2) from the socket FD into BUFFER[START,END).  Returns the byte count
(0 at EOF), or -1 and the errno.  Retries EINTR."
  (declare (type fd fd) (type octets buffer) (type fixnum start end))
  (sb-sys:with-pinned-objects (buffer)
    (loop
      (let ((n (%recv fd (sb-sys:sap+ (sb-sys:vector-sap buffer) start) (- end start) 0)))
        (declare (type fixnum n))
        (cond ((>= n 0) (return (values n 0)))
              (t (let ((errno (%errno)))
                   (unless (= errno +eintr+)
                     (return (values -1 errno))))))))))

(defun peek-request (fd)
  "What the client of the non-blocking socket FD has sent so far, left
unread: :NONE (nothing, or its end), :PARTIAL (part of a request head, or
a head longer than 4 KiB) or :COMPLETE (a whole head: an empty line, LF LF
or LF CR LF, as SCAN-HEAD finds it)."
  (sb-alien:with-alien ((buffer (array (sb-alien:unsigned 8) 4096)))
    (let* ((sap (sb-alien:alien-sap buffer))
           (n (%recv fd sap 4096 (logior +msg-peek+ +msg-dontwait+))))
      (declare (type fixnum n))
      (cond ((<= n 0) :none)
            ((loop for i of-type fixnum from 0 below (1- n)
                   thereis (and (= (sb-sys:sap-ref-8 sap i) 10)
                                (or (= (sb-sys:sap-ref-8 sap (1+ i)) 10)
                                    (and (< (+ i 2) n)
                                         (= (sb-sys:sap-ref-8 sap (1+ i)) 13)
                                         (= (sb-sys:sap-ref-8 sap (+ i 2)) 10)))))
             :complete)
            (t :partial)))))

(defun send-from (fd buffer start end)
  "send(2) BUFFER[START,END) without raising SIGPIPE.  Returns the count
written or -1 and the errno.  Retries EINTR."
  (declare (type fd fd) (type octets buffer) (type fixnum start end))
  (sb-sys:with-pinned-objects (buffer)
    (loop
      (let ((n (%send fd (sb-sys:sap+ (sb-sys:vector-sap buffer) start) (- end start)
                      +msg-nosignal+)))
        (declare (type fixnum n))
        (cond ((>= n 0) (return (values n 0)))
              (t (let ((errno (%errno)))
                   (unless (= errno +eintr+)
                     (return (values -1 errno))))))))))

(defconstant +o-rdwr+ 2)
(defconstant +o-creat+ #o100)
(defconstant +o-excl+ #o200)
(defconstant +eexist+ 17)

(sb-ext:defglobal **temporary-files** (list 0)
  "A count of the temporary files made, in its CAR: their names' suffix.")

(defun open-temporary-file (directory)
  "A new, empty file in DIRECTORY (a namestring ending in /), open for reading
and writing, already unlinked: it has no name, and its blocks are freed when
its fd closes, whatever happens to the process.  Returns the fd, or -1 and
the errno."
  (loop repeat 100
        do (let* ((path (format nil "~Agallop-body-~D-~D" directory (sb-unix:unix-getpid)
                               (sb-ext:atomic-incf (car **temporary-files**))))
                  (fd (%open-file path (logior +o-rdwr+ +o-creat+ +o-excl+ +o-cloexec+) #o600)))
             (cond ((>= fd 0)
                    (%unlink path)
                    (return-from open-temporary-file fd))
                   ((/= (%errno) +eexist+)
                    (return-from open-temporary-file (values -1 (%errno)))))))
  (values -1 +eexist+))

(defun write-fd-all (fd buffer start end)
  "write(2) BUFFER[START,END) to the file FD, all of it.  Returns NIL, or the
errno when a write failed (ENOSPC: the disk is full)."
  (declare (type fd fd) (type octets buffer) (type fixnum start end))
  (sb-sys:with-pinned-objects (buffer)
    (loop while (< start end)
          do (let ((n (%write fd (sb-sys:sap+ (sb-sys:vector-sap buffer) start) (- end start))))
               (declare (type fixnum n))
               (cond ((plusp n) (incf start n))
                     ((and (minusp n) (= (%errno) +eintr+)))
                     (t (return-from write-fd-all (if (minusp n) (%errno) 28)))))))
  nil)

(defun pread-into (fd buffer start end offset)
  "pread(2) from the file FD at OFFSET into BUFFER[START,END).  Returns the
count read (0 at its end), or -1 and the errno.  Retries EINTR."
  (declare (type fd fd) (type octets buffer) (type fixnum start end offset))
  (sb-sys:with-pinned-objects (buffer)
    (loop
      (let ((n (%pread-file fd (sb-sys:sap+ (sb-sys:vector-sap buffer) start) (- end start) offset)))
        (declare (type fixnum n))
        (cond ((>= n 0) (return (values n 0)))
              ((/= (%errno) +eintr+) (return (values -1 (%errno)))))))))

(defun send-file-chunk (out-fd in-fd offset count)
  "sendfile(2) up to COUNT bytes of IN-FD from OFFSET to OUT-FD.  Returns the
count sent or -1 and the errno.  Retries EINTR."
  (sb-alien:with-alien ((off (sb-alien:signed 64) offset))
    (loop
      (let ((n (%sendfile out-fd in-fd (sb-alien:alien-sap (sb-alien:addr off)) count)))
        (cond ((>= n 0) (return (values n 0)))
              ((/= (%errno) +eintr+) (return (values -1 (%errno)))))))))

(defun poll-fds (fd events wake-fd timeout-ms)
  "poll(2) FD for EVENTS and WAKE-FD (or -1) for input.  Returns :READY,
:WAKE, :TIMEOUT.  EINTR restarts the wait with the remaining time."
  (declare (type fd fd wake-fd) (type fixnum timeout-ms))
  (let ((deadline (+ (now-ms) (max timeout-ms 0))))
    (sb-alien:with-alien ((pfds (array (sb-alien:unsigned 8) 16)))
      (let ((sap (sb-alien:alien-sap pfds)))
        (loop
          (setf (sb-sys:signed-sap-ref-32 sap 0) fd
                (sb-sys:sap-ref-16 sap 4) events
                (sb-sys:sap-ref-16 sap 6) 0
                (sb-sys:signed-sap-ref-32 sap 8) wake-fd
                (sb-sys:sap-ref-16 sap 12) +pollin+
                (sb-sys:sap-ref-16 sap 14) 0)
          (let* ((remaining (if (< timeout-ms 0) -1 (max 0 (- deadline (now-ms)))))
                 (n (%poll sap 2 remaining)))
            (cond ((> n 0)
                   (return (if (and (>= wake-fd 0)
                                    (logtest (sb-sys:sap-ref-16 sap 14) +pollin+))
                               :wake
                               :ready)))
                  ((= n 0) (return :timeout))
                  ((/= (%errno) +eintr+)
                   (error "poll failed: errno ~D" (%errno))))))))))

(defun accept-connection (listen-fd)
  "accept4(2) one connection, non-blocking and close-on-exec.  Returns the
fd, the peer address as an octet vector (4 or 16 bytes) and the peer port;
or -1 and the errno."
  (sb-alien:with-alien ((addr (array (sb-alien:unsigned 8) 32))
                        (len (sb-alien:unsigned 32) 32))
    (let ((sap (sb-alien:alien-sap addr)))
      (loop
        (let ((fd (%accept4 listen-fd sap (sb-alien:alien-sap (sb-alien:addr len))
                            (logior +sock-nonblock+ +sock-cloexec+))))
          (cond ((>= fd 0)
                 (multiple-value-bind (address port) (parse-sockaddr sap)
                   (return (values fd address port))))
                ((/= (%errno) +eintr+)
                 (return (values -1 (%errno))))))))))

(defun parse-sockaddr (sap)
  "Decode a struct sockaddr_in or sockaddr_in6 at SAP into an octet vector and a port."
  (let ((family (sb-sys:sap-ref-16 sap 0))
        (port (logior (ash (sb-sys:sap-ref-8 sap 2) 8) (sb-sys:sap-ref-8 sap 3))))
    (case family
      (2 (let ((v (make-array 4 :element-type '(unsigned-byte 8))))
           (dotimes (i 4) (setf (aref v i) (sb-sys:sap-ref-8 sap (+ 4 i))))
           (values v port)))
      (10 (if (and (loop for i from 8 below 18 always (zerop (sb-sys:sap-ref-8 sap i)))
                   (= #xff (sb-sys:sap-ref-8 sap 18) (sb-sys:sap-ref-8 sap 19)))
              ;; An IPv4 peer of a dual-stack IPv6 socket (::ffff:a.b.c.d,
              ;; what a socket unit's ListenStream=PORT makes): its IPv4
              ;; address, as an IPv4 socket gives it.
              (let ((v (make-array 4 :element-type '(unsigned-byte 8))))
                (dotimes (i 4) (setf (aref v i) (sb-sys:sap-ref-8 sap (+ 20 i))))
                (values v port))
              (let ((v (make-array 16 :element-type '(unsigned-byte 8))))
                (dotimes (i 16) (setf (aref v i) (sb-sys:sap-ref-8 sap (+ 8 i))))
                (values v port))))
      (t (values (make-array 4 :element-type '(unsigned-byte 8) :initial-element 0) 0)))))

(defun socket-local-name (fd)
  "getsockname(2) of FD as an octet vector and a port."
  (sb-alien:with-alien ((addr (array (sb-alien:unsigned 8) 32))
                        (len (sb-alien:unsigned 32) 32))
    (let ((sap (sb-alien:alien-sap addr)))
      (if (zerop (%getsockname fd sap (sb-alien:alien-sap (sb-alien:addr len))))
          (parse-sockaddr sap)
          (values (make-array 4 :element-type '(unsigned-byte 8) :initial-element 0) 0)))))

;;; the fd limit

(defun fd-limit ()
  "The soft and hard RLIMIT_NOFILE of this process."
  (sb-alien:with-alien ((lim (array (sb-alien:unsigned 64) 2)))
    (let ((sap (sb-alien:alien-sap lim)))
      (%getrlimit +rlimit-nofile+ sap)
      (values (sb-sys:sap-ref-64 sap 0) (sb-sys:sap-ref-64 sap 8)))))

(defun raise-fd-limit (&optional (wanted most-positive-fixnum))
  "Raise the soft RLIMIT_NOFILE towards WANTED, up to the hard limit.
Returns the new soft limit, and T as a second value when it is below WANTED
(the caller should say so: connections beyond it will be refused)."
  (multiple-value-bind (soft hard) (fd-limit)
    (let ((target (min wanted hard)))
      (when (> target soft)
        (sb-alien:with-alien ((lim (array (sb-alien:unsigned 64) 2)))
          (let ((sap (sb-alien:alien-sap lim)))
            (setf (sb-sys:sap-ref-64 sap 0) target
                  (sb-sys:sap-ref-64 sap 8) hard)
            (when (zerop (%setrlimit +rlimit-nofile+ sap))
              (setf soft target)))))
      (values soft (< soft wanted)))))

(sb-alien:define-alien-routine ("sched_getaffinity" %sched-getaffinity) sb-alien:int
  (pid sb-alien:int) (size sb-alien:unsigned-long) (mask sb-sys:system-area-pointer))

(defun allowed-cpu-mask ()
  "The CPUs this process may run on (its affinity mask, e.g. under taskset),
as an integer whose bit N is set for CPU N (the first 1024 CPUs); CPU 0
alone if the mask can't be read."
  (sb-alien:with-alien ((mask (array (sb-alien:unsigned 64) 16)))
    (let ((sap (sb-alien:alien-sap mask)))
      (if (zerop (%sched-getaffinity 0 128 sap))
          (let ((bits (loop for i below 16
                            sum (ash (sb-sys:sap-ref-64 sap (* 8 i)) (* 64 i)))))
            (if (zerop bits) 1 bits))
          1))))

(defun allowed-cpu-count ()
  "How many CPUs this process may run on (its affinity mask, e.g. under taskset)."
  (logcount (allowed-cpu-mask)))

;;; The process's CPU time, read by the pool's maker every 5 ms while it
;;; samples.  Linux sums it over every thread of the process at each read
;;; (getrusage, and CLOCK_PROCESS_CPUTIME_ID), unless a CPU timer of the
;;; process is armed: then the scheduler keeps a running total, which a read
;;; of the clock returns as it is.  A process holding thousands of threads
;;; (switched WebSockets, each reading in its own thread) would otherwise pay
;;; a walk over all of them at every sample, the idle ones too.  So the first
;;; read arms a timer on that clock that never comes due (its expiry is the
;;; clock's largest value, centuries of CPU time), and notifies with a signal
;;; whose default action is to be ignored: a timer that notifies no one
;;; (SIGEV_NONE) is not armed by the kernel, and keeps no total.  When the
;;; timer cannot be made, the clock is still read, with the walk.

(defconstant +clock-process-cputime+ 2)
(defconstant +sigwinch+ 28)

(defvar *process-cpu-timer-pid* 0
  "The process id for which the timer that keeps the process's CPU time
summed up was made (a saved image starts without it), or 0.")

(defvar *process-cpu-timer-lock* (sb-thread:make-mutex :name "gallop process CPU timer"))

(defun arm-process-cpu-timer ()
  "Arm, once per process, a CPU timer of the process that never comes due
\(see above).  True when armed."
  (sb-thread:with-mutex (*process-cpu-timer-lock*)
    (let ((pid (sb-unix:unix-getpid)))
      (or (= pid *process-cpu-timer-pid*)
          (sb-alien:with-alien ((event (array (sb-alien:unsigned 8) 64))
                                (timer (array (sb-alien:unsigned 64) 1))
                                (spec (array (sb-alien:signed 64) 4)))
            (let ((sap (sb-alien:alien-sap event)))
              (dotimes (i 64) (setf (sb-sys:sap-ref-8 sap i) 0))
              ;; struct sigevent: sigev_signo at 8, sigev_notify (0:
              ;; SIGEV_SIGNAL) at 12.
              (setf (sb-sys:sap-ref-32 sap 8) +sigwinch+))
            (when (zerop (sb-alien:alien-funcall
                          (sb-alien:extern-alien "timer_create"
                                                 (function sb-alien:int sb-alien:int
                                                           sb-sys:system-area-pointer
                                                           sb-sys:system-area-pointer))
                          +clock-process-cputime+ (sb-alien:alien-sap event)
                          (sb-alien:alien-sap timer)))
              ;; No interval; due at the clock's largest value (TIMER_ABSTIME,
              ;; seconds past it read as it).
              (setf (sb-alien:deref spec 0) 0 (sb-alien:deref spec 1) 0
                    (sb-alien:deref spec 2) (1- (expt 2 40)) (sb-alien:deref spec 3) 0)
              (when (zerop (sb-alien:alien-funcall
                            (sb-alien:extern-alien "timer_settime"
                                                   (function sb-alien:int sb-alien:unsigned-long
                                                             sb-alien:int sb-sys:system-area-pointer
                                                             sb-sys:system-area-pointer))
                            (sb-alien:deref timer 0) 1 (sb-alien:alien-sap spec)
                            (sb-sys:int-sap 0)))
                (setf *process-cpu-timer-pid* pid)
                t)))))))

(defun process-cpu-us ()
  "CPU time (user + system) this process has used, in microseconds; a read
that costs the same however many threads the process has (see above)."
  (unless (= (sb-unix:unix-getpid) *process-cpu-timer-pid*)
    (arm-process-cpu-timer))
  (multiple-value-bind (seconds nanoseconds) (clock-gettime +clock-process-cputime+)
    (+ (* seconds 1000000) (floor nanoseconds 1000))))

(defconstant +thread-fixed-octets+ (* 5 512 1024)
  "What an SBCL thread maps besides its control stack and its thread-local
storage: its binding and alien stacks (1 MiB each, fixed in SBCL's
runtime), its signal stack, guard pages and thread structure (under 512 KiB
together with SBCL 2.2.9 on x86-64, as /proc/self/maps shows).")

(defun thread-octets ()
  "The memory one more thread of this process maps: its control stack
\(SBCL's --control-stack-size), its thread-local storage (--tls-limit) and
+THREAD-FIXED-OCTETS+.  The whole of each stack, not what is in use: the
code a thread runs may fill its stack, and that memory is not given back
while the thread lives."
  (+ (sb-alien:extern-alien "thread_control_stack_size" sb-alien:unsigned-long)
     (sb-alien:extern-alien "dynamic_values_bytes" (sb-alien:signed 32))
     +thread-fixed-octets+))

(defun listen-socket-fd (socket)
  "The fd of an SB-BSD-SOCKETS socket."
  (sb-bsd-sockets:socket-file-descriptor socket))
