;;;; response.lisp -- writing HTTP/1.1 responses straight into a connection's
;;;; output buffer: status lines encoded once, the Date line formatted at most
;;;; once a second, header names encoded once per keyword, and head and body
;;;; sent together by one send(2) when they fit the buffer.

(in-package #:gallop)

(deftype octets () '(simple-array (unsigned-byte 8) (*)))

(defun ascii (string)
  "STRING as octets; characters above 255 become ?."
  (let ((v (make-array (length string) :element-type '(unsigned-byte 8))))
    (dotimes (i (length string) v)
      (let ((code (char-code (char string i))))
        (setf (aref v i) (if (< code 256) code 63))))))

(defparameter +reason-phrases+
  '((100 . "Continue") (101 . "Switching Protocols") (200 . "OK") (201 . "Created")
    (202 . "Accepted") (203 . "Non-Authoritative Information") (204 . "No Content")
    (205 . "Reset Content") (206 . "Partial Content") (300 . "Multiple Choices")
    (301 . "Moved Permanently") (302 . "Found") (303 . "See Other") (304 . "Not Modified")
    (307 . "Temporary Redirect") (308 . "Permanent Redirect") (400 . "Bad Request")
    (401 . "Unauthorized") (402 . "Payment Required") (403 . "Forbidden")
    (404 . "Not Found") (405 . "Method Not Allowed") (406 . "Not Acceptable")
    (408 . "Request Timeout") (409 . "Conflict") (410 . "Gone") (411 . "Length Required")
    (412 . "Precondition Failed") (413 . "Content Too Large") (414 . "URI Too Long")
    (415 . "Unsupported Media Type") (416 . "Range Not Satisfiable")
    (417 . "Expectation Failed") (422 . "Unprocessable Content") (426 . "Upgrade Required")
    (428 . "Precondition Required") (429 . "Too Many Requests")
    (431 . "Request Header Fields Too Large") (500 . "Internal Server Error")
    (501 . "Not Implemented") (502 . "Bad Gateway") (503 . "Service Unavailable")
    (504 . "Gateway Timeout") (505 . "HTTP Version Not Supported")))

(defparameter +status-lines+
  (let ((lines (make-array 600 :initial-element nil)))
    (loop for code from 100 below 600
          do (setf (svref lines code)
                   (ascii (format nil "HTTP/1.1 ~D ~A~C~C" code
                                  (or (cdr (assoc code +reason-phrases+)) "Status")
                                  #\Return #\Linefeed))))
    lines)
  "Status line octets for each code, encoded once.")

(defparameter +crlf+ (ascii (format nil "~C~C" #\Return #\Linefeed)))
(defparameter +colon-space+ (ascii ": "))
(defparameter +content-length-prefix+ (ascii (format nil "Content-Length: ")))
(defparameter +chunked-line+ (ascii (format nil "Transfer-Encoding: chunked~C~C" #\Return #\Linefeed)))
(defparameter +connection-close-line+ (ascii (format nil "Connection: close~C~C" #\Return #\Linefeed)))
(defparameter +keep-alive-line+ (ascii (format nil "Connection: keep-alive~C~C" #\Return #\Linefeed)))
(defparameter +continue-response+ (ascii (format nil "HTTP/1.1 100 Continue~C~C~C~C"
                                                 #\Return #\Linefeed #\Return #\Linefeed)))
(defparameter +last-chunk+ (ascii (format nil "0~C~C~C~C" #\Return #\Linefeed #\Return #\Linefeed)))

(defun status-line (code)
  (or (and (integerp code) (< 99 code 600) (svref +status-lines+ code))
      (svref +status-lines+ 500)))

;;; Date, formatted at most once a second.  The cached pair is replaced, never
;;; mutated, so readers on other threads see a consistent one.

(defvar *date-line* (cons -1 nil)
  "(universal-time . \"Date: ...\\r\\n\" octets)")

(defun date-line ()
  (let ((now (get-universal-time))
        (cached *date-line*))
    (if (= now (car cached))
        (cdr cached)
        (multiple-value-bind (s m h day month year weekday) (decode-universal-time now 0)
          (let ((line (ascii (format nil "Date: ~A, ~2,'0D ~A ~D ~2,'0D:~2,'0D:~2,'0D GMT~C~C"
                                     (svref #("Mon" "Tue" "Wed" "Thu" "Fri" "Sat" "Sun") weekday)
                                     day
                                     (svref #("Jan" "Feb" "Mar" "Apr" "May" "Jun" "Jul"
                                              "Aug" "Sep" "Oct" "Nov" "Dec") (1- month))
                                     year h m s #\Return #\Linefeed))))
            (setf *date-line* (cons now line))
            line)))))

;;; Header names

(defun header-name-octets (name)
  "\"Name: \" as octets for a header NAME (a keyword is capitalized:
:CONTENT-TYPE gives Content-Type), cached on the keyword."
  (if (symbolp name)
      (or (get name 'header-octets)
          (setf (get name 'header-octets)
                (ascii (concatenate 'string
                                    (string-capitalize (symbol-name name))
                                    ": "))))
      (ascii (concatenate 'string (string name) ": "))))

(defun write-header-value (c value)
  "Write VALUE (a string, or anything PRINC can show) as latin-1; CR and LF
become spaces, so a value can't inject a header."
  (gallop.core:connection-write-latin1 c (if (stringp value) value (princ-to-string value))))

;;; Bodies

(defun simple-ascii-string-p (object)
  "True if OBJECT is a simple string of ASCII characters only (its UTF-8
encoding is its character codes)."
  (and (simple-string-p object)
       (let ((string object))
         (declare (type simple-string string) (optimize speed))
         (every (lambda (ch) (< (char-code ch) 128)) string))))

(defun body-octets (chunk)
  "A body chunk (string or octet vector) as octets; strings in UTF-8."
  (etypecase chunk
    (octets chunk)
    (string (sb-ext:string-to-octets chunk :external-format :utf-8))
    ((vector (unsigned-byte 8)) (coerce chunk 'octets))
    (null (make-array 0 :element-type '(unsigned-byte 8)))))

(defun header-value (headers name)
  "The value of header NAME (a keyword) in the property list HEADERS."
  (loop for (key value) on headers by #'cddr
        when (string-equal key name) return value))

(defun no-body-status-p (status)
  (or (< status 200) (= status 204) (= status 304)))

(defun write-head (c status headers &key content-length chunked keep-alive http-1.0)
  "Write the status line and headers.  Adds Date, Content-Length (when known
and the app did not give one), Transfer-Encoding and Connection."
  (gallop.core:connection-write-octets c (status-line status))
  (gallop.core:connection-write-octets c (date-line))
  (let ((has-length nil))
    (loop for (name value) on headers by #'cddr
          when value
            do (when (if (symbolp name)
                         (eq name :content-length)
                         (string-equal name :content-length))
                 (setf has-length t))
               (gallop.core:connection-write-octets c (header-name-octets name))
               (write-header-value c value)
               (gallop.core:connection-write-octets c +crlf+))
    (when (and content-length (not has-length))
      (gallop.core:connection-write-octets c +content-length-prefix+)
      (gallop.core:connection-write-decimal c content-length)
      (gallop.core:connection-write-octets c +crlf+)))
  (when chunked
    (gallop.core:connection-write-octets c +chunked-line+))
  (cond ((not keep-alive) (gallop.core:connection-write-octets c +connection-close-line+))
        (http-1.0 (gallop.core:connection-write-octets c +keep-alive-line+)))
  (gallop.core:connection-write-octets c +crlf+))

(defun write-chunk (c octets)
  "One chunk of a chunked body."
  (when (plusp (length octets))
    (gallop.core:connection-write-octets c (ascii (format nil "~X~C~C" (length octets)
                                                          #\Return #\Linefeed)))
    (gallop.core:connection-write-octets c octets)
    (gallop.core:connection-write-octets c +crlf+)))
