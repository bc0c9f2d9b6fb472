;;;; sockets.lisp -- raw non-blocking client sockets for the load
;;;; generators that drive thousands of connections (heads.lisp,
;;;; attacks.lisp): socket(2), connect(2), send(2), recv(2) and poll(2)
;;;; called directly, without sb-bsd-sockets' objects and finalizers.

(defpackage #:gallop-bench-sockets
  (:use #:common-lisp #:gallop-bench-process)
  (:export #:%close #:%connect #:%getsockopt #:%poll #:%recv #:%send
          #:%setsockopt #:%socket #:+af-inet+ #:+eagain+ #:+einprogress+
          #:+eintr+ #:+msg-dontwait+ #:+msg-nosignal+ #:+pollerr+ #:+pollhup+
          #:+pollin+ #:+pollout+ #:+so-error+ #:+so-sndbuf+ #:+sock-cloexec+
          #:+sock-nonblock+ #:+sock-stream+ #:+sol-socket+
          #:loopback-address #:octets #:open-socket #:poll-fds
          #:receive-some #:send-some #:socket-error))
(in-package #:gallop-bench-sockets)

(defconstant +af-inet+ 2)
(defconstant +sock-stream+ 1)
(defconstant +sock-nonblock+ #o4000)
(defconstant +sock-cloexec+ #o2000000)
(defconstant +sol-socket+ 1)
(defconstant +so-error+ 4)
(defconstant +so-sndbuf+ 7)
(defconstant +msg-dontwait+ #x40)
(defconstant +msg-nosignal+ #x4000)
(defconstant +pollin+ 1)
(defconstant +pollout+ 4)
(defconstant +pollerr+ 8)
(defconstant +pollhup+ 16)
(defconstant +eintr+ 4)
(defconstant +eagain+ 11)
(defconstant +einprogress+ 115)

(sb-alien:define-alien-routine ("socket" %socket) sb-alien:int
  (domain sb-alien:int) (type sb-alien:int) (protocol sb-alien:int))
(sb-alien:define-alien-routine ("connect" %connect) sb-alien:int
  (fd sb-alien:int) (addr sb-sys:system-area-pointer) (len sb-alien:unsigned-int))
(sb-alien:define-alien-routine ("send" %send) sb-alien:long
  (fd sb-alien:int) (buf sb-sys:system-area-pointer) (len sb-alien:unsigned-long)
  (flags sb-alien:int))
(sb-alien:define-alien-routine ("recv" %recv) sb-alien:long
  (fd sb-alien:int) (buf sb-sys:system-area-pointer) (len sb-alien:unsigned-long)
  (flags sb-alien:int))
(sb-alien:define-alien-routine ("close" %close) sb-alien:int (fd sb-alien:int))
(sb-alien:define-alien-routine ("poll" %poll) sb-alien:int
  (fds sb-sys:system-area-pointer) (nfds sb-alien:unsigned-long) (timeout sb-alien:int))
(sb-alien:define-alien-routine ("getsockopt" %getsockopt) sb-alien:int
  (fd sb-alien:int) (level sb-alien:int) (name sb-alien:int)
  (value sb-sys:system-area-pointer) (length sb-sys:system-area-pointer))
(sb-alien:define-alien-routine ("setsockopt" %setsockopt) sb-alien:int
  (fd sb-alien:int) (level sb-alien:int) (name sb-alien:int)
  (value sb-sys:system-area-pointer) (length sb-alien:unsigned-int))

(deftype octets () '(simple-array (unsigned-byte 8) (*)))

(defun loopback-address (port)
  "A struct sockaddr_in for 127.0.0.1:PORT, as octets."
  (let ((a (make-array 16 :element-type '(unsigned-byte 8) :initial-element 0)))
    (setf (aref a 0) +af-inet+            ; sin_family, little-endian
          (aref a 2) (ldb (byte 8 8) port) ; sin_port, network order
          (aref a 3) (ldb (byte 8 0) port)
          (aref a 4) 127 (aref a 7) 1)
    a))

(defun open-socket (address &key send-buffer)
  "A non-blocking socket connecting to ADDRESS (a sockaddr_in), with
SO_SNDBUF set to SEND-BUFFER if given: its fd, or NIL and the errno."
  (let ((fd (%socket +af-inet+ (logior +sock-stream+ +sock-nonblock+ +sock-cloexec+) 0)))
    (when (and (>= fd 0) send-buffer)
      (sb-alien:with-alien ((value sb-alien:int send-buffer))
        (%setsockopt fd +sol-socket+ +so-sndbuf+ (sb-alien:alien-sap (sb-alien:addr value)) 4)))
    (if (< fd 0)
        (values nil (sb-alien:get-errno))
        (let ((r (sb-sys:with-pinned-objects (address)
                   (%connect fd (sb-sys:vector-sap address) 16))))
          (if (or (zerop r) (= (sb-alien:get-errno) +einprogress+))
              fd
              (let ((errno (sb-alien:get-errno)))
                (%close fd)
                (values nil errno)))))))

(defun socket-error (fd)
  "The pending error of socket FD (SO_ERROR), 0 when none."
  (sb-alien:with-alien ((value sb-alien:int 0) (length sb-alien:unsigned-int 4))
    (if (zerop (%getsockopt fd +sol-socket+ +so-error+
                            (sb-alien:alien-sap (sb-alien:addr value))
                            (sb-alien:alien-sap (sb-alien:addr length))))
        value
        (sb-alien:get-errno))))

(defun send-some (fd octets start end)
  "Send OCTETS[START, END) on FD without blocking: octets sent (0: would
block), or NIL and the errno."
  (declare (type octets octets) (type fixnum start end))
  (let ((n (sb-sys:with-pinned-objects (octets)
             (%send fd (sb-sys:sap+ (sb-sys:vector-sap octets) start) (- end start)
                    (logior +msg-dontwait+ +msg-nosignal+)))))
    (cond ((>= n 0) n)
          (t (let ((errno (sb-alien:get-errno)))
               (if (or (= errno +eagain+) (= errno +eintr+)) 0 (values nil errno)))))))

(defun receive-some (fd buffer start)
  "Receive into BUFFER from START without blocking: octets read (0: end of
file), :AGAIN, or NIL and the errno."
  (declare (type octets buffer) (type fixnum start))
  (let ((n (sb-sys:with-pinned-objects (buffer)
             (%recv fd (sb-sys:sap+ (sb-sys:vector-sap buffer) start) (- (length buffer) start)
                    +msg-dontwait+))))
    (cond ((>= n 0) n)
          (t (let ((errno (sb-alien:get-errno)))
               (if (or (= errno +eagain+) (= errno +eintr+)) :again (values nil errno)))))))

(defun poll-fds (fds events timeout-ms)
  "poll(2) the fds in the vector FDS, each for the matching entry of EVENTS,
for up to TIMEOUT-MS; a vector of their revents."
  (let* ((n (length fds))
         (table (make-array (max 8 (* 8 n)) :element-type '(unsigned-byte 8)
                                            :initial-element 0))
         (revents (make-array n :element-type 'fixnum :initial-element 0)))
    (sb-sys:with-pinned-objects (table)
      (let ((sap (sb-sys:vector-sap table)))
        (dotimes (i n)
          (setf (sb-sys:signed-sap-ref-32 sap (* 8 i)) (aref fds i)
                (sb-sys:sap-ref-16 sap (+ 4 (* 8 i))) (aref events i)))
        (when (plusp n)
          (%poll sap n timeout-ms))
        (dotimes (i n)
          (setf (aref revents i) (sb-sys:sap-ref-16 sap (+ 6 (* 8 i)))))))
    revents))
